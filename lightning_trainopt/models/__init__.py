"""The demo LLaMA-style transformer and its Lightning module."""

from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT, Block
from lightning_trainopt.models.lit_gpt import LitGPT

__all__ = ["GPT", "Block", "GPTConfig", "LitGPT"]
