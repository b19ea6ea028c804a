"""Builders of our GPT for tests."""

from __future__ import annotations

import torch

from lightning_trainopt.models import GPT, GPTConfig


def gpt_in_dtype(cfg: GPTConfig, dtype: torch.dtype) -> GPT:
    """``GPT(cfg)`` with parameters created in ``dtype``.

    Fake or meta parameters cannot be converted with ``.to()``, so the default dtype is switched while building.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return GPT(cfg)
    finally:
        torch.set_default_dtype(previous)
