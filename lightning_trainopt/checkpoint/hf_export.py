"""Our LLaMA-style ``GPT`` as a Hugging Face ``LlamaForCausalLM``: the same computation, renamed tensors.

The two models differ in names and in one layout: our rotary embedding rotates adjacent pairs of a head's channels
(``(0, 1), (2, 3), ...``, Meta's original layout), Hugging Face's Llama rotates the two halves (``(i, i + D/2)``).
The q and k projections' rows are permuted per head so that Llama's rotation acts on the same pairs
(``convert_llama_weights_to_hf.py``'s ``permute`` in transformers does the same for Meta's weights); everything
else is a rename.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from lightning_trainopt.models import GPTConfig

__all__ = ["gpt_to_llama", "llama_config"]

_RENAMES = (
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
    (r"^blocks\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blocks\.(\d+)\.mlp_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blocks\.(\d+)\.attn\.(q|k|v|o)_proj\.weight$", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"^blocks\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", r"model.layers.\1.mlp.\2_proj.weight"),
)


def llama_config(cfg: GPTConfig) -> Any:
    """The ``transformers.LlamaConfig`` of the same shape as ``cfg``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        dtype="float32",
    )


def _pairs_to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's output rows from adjacent rotary pairs to rotary halves."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rename(key: str) -> str:
    for pattern, target in _RENAMES:
        new, n = re.subn(pattern, target, key)
        if n:
            return new
    raise KeyError(f"{key} is not a tensor of lightning_trainopt's GPT; no Llama name for it")


def gpt_to_llama(
    state: dict[str, torch.Tensor], cfg: GPTConfig, hf_dir: str | os.PathLike[str] | None = None
) -> dict[str, torch.Tensor]:
    """``state`` (a plain ``GPT.state_dict()``) under ``LlamaForCausalLM``'s names and layout; optionally saved as a
    Hugging Face model directory.

    The directory holds ``config.json`` and safetensors (sharded with an index above 5 GB, as ``save_pretrained``
    writes them), so ``AutoModelForCausalLM.from_pretrained(hf_dir)`` and ``model=hf model.pretrained=hf_dir``
    load it. No model is built: the tensors are written as they are.

    Args:
        state: the plain model's tensors (``embed.weight``, ``blocks.0.attn.q_proj.weight``, ...).
        cfg: the model's shape.
        hf_dir: where to write the directory; ``None``: only convert.

    Raises:
        KeyError: a tensor that is not one of our GPT's.
    """
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.endswith("attn.q_proj.weight"):
            tensor = _pairs_to_halves(tensor, cfg.n_heads)
        elif key.endswith("attn.k_proj.weight"):
            tensor = _pairs_to_halves(tensor, cfg.kv_heads)
        converted[_rename(key)] = tensor.contiguous()
    if cfg.tie_embeddings:
        # Llama ties lm_head to embed_tokens itself (tie_word_embeddings); save_pretrained leaves it out too.
        converted.pop("lm_head.weight", None)
    if hf_dir is not None:
        from huggingface_hub import save_torch_state_dict

        os.makedirs(hf_dir, exist_ok=True)
        llama_config(cfg).save_pretrained(os.fspath(hf_dir))
        save_torch_state_dict(converted, os.fspath(hf_dir), metadata={"format": "pt"})
    return converted
