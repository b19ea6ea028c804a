"""Tiny Hugging Face model files on disk (``config.json``, weights), written from config objects: no download."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["write_config", "write_pretrained"]


def _config(kind: str, vocab_size: int, **overrides: Any) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if kind == "llama":
        fields: dict[str, Any] = {
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        }
        return transformers.LlamaConfig(**{**fields, **overrides})
    if kind == "gpt2":
        fields = {"vocab_size": vocab_size, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128}
        return transformers.GPT2Config(**{**fields, "bos_token_id": 0, "eos_token_id": 0, **overrides})
    raise ValueError(f"unknown kind {kind!r}; use llama or gpt2")


def write_config(kind: str, directory: Path, vocab_size: int = 256, **overrides: Any) -> Path:
    """``directory/config.json`` of a tiny ``llama`` (2 layers, hidden 32, GQA 4/2) or ``gpt2``; returns the file."""
    _config(kind, vocab_size, **overrides).save_pretrained(directory)
    return directory / "config.json"


def write_pretrained(kind: str, directory: Path, vocab_size: int = 256, seed: int = 0, **overrides: Any) -> Any:
    """A tiny model with random weights saved by ``save_pretrained`` into ``directory`` (``overrides``: config
    fields); returns the model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, vocab_size, **overrides))
    model.save_pretrained(directory)
    return model
