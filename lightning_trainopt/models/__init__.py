"""The demo LLaMA-style transformer, Hugging Face causal LMs, and their Lightning modules."""

from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT, Block
from lightning_trainopt.models.hf import LitCausalLM
from lightning_trainopt.models.hf_config import HFModelConfig
from lightning_trainopt.models.lit_gpt import LitGPT
from lightning_trainopt.models.lit_lm import LitLanguageModel

__all__ = ["GPT", "Block", "GPTConfig", "HFModelConfig", "LitCausalLM", "LitGPT", "LitLanguageModel"]
