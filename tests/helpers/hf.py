"""Tiny Hugging Face causal LMs (``LlamaForCausalLM``, ``GPT2LMHeadModel``) inside an ordinary LightningModule.

Built from config objects, so nothing is downloaded. The module is written the way users write one: it holds the
Hugging Face model as ``self.model``, takes dict batches ``{input_ids, attention_mask, labels}`` (right padding,
lengths varying from row to row and batch to batch, ``labels`` -100 on the padding), calls the model with keywords
and returns its loss. Nothing in it knows about our callbacks; the model keeps its defaults (``use_cache=True``).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch

from tests.unit.callbacks._foreign import loader, padded_batches

__all__ = ["HF_KINDS", "HFCausalLM", "hf_batches", "hf_model", "hf_module", "loader"]

VOCAB = 64
HF_KINDS = ("llama", "gpt2")


def hf_model(kind: str, n_layers: int = 2, **overrides: Any) -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM`` (``kind="llama"``) or ``GPT2LMHeadModel`` (``"gpt2"``) with random weights.

    ``overrides`` go to the config (e.g. ``attn_implementation="eager"``).
    """
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny vocabulary makes GPT-2's config warn about its token ids
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    if kind == "llama":
        cfg: Any = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **overrides,
        )
        return transformers.LlamaForCausalLM(cfg)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=n_layers,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            **overrides,
        )
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(f"unknown Hugging Face model kind {kind!r}; use one of {HF_KINDS}")


class HFCausalLM(pl.LightningModule):
    """A user's LightningModule around a Hugging Face causal LM: ``forward(input_ids, attention_mask, labels)``."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def hf_module(kind: str, n_layers: int = 2, **overrides: Any) -> HFCausalLM:
    """:class:`HFCausalLM` around :func:`hf_model`."""
    return HFCausalLM(hf_model(kind, n_layers, **overrides))


def hf_batches(n: int, batch_size: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` causal-LM micro-batches: the padded batches of ``_foreign.padded_batches`` (lengths 4-16, right
    padding), with ``labels`` the input ids and -100 on the padding."""
    out = []
    for b in padded_batches(n, batch_size, seed):
        labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
        out.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "labels": labels})
    return out
