"""Tiny LitGPT fits for callback tests (a few steps, seconds on 2 CPU cores)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_trainopt.data.datamodule import TextDataModule
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.lit_gpt import LitGPT

TINY = GPTConfig(name="tiny-test", vocab_size=64, n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=16)


def tiny_module(**kwargs: Any) -> LitGPT:
    return LitGPT(TINY, **kwargs)


def tiny_data(batch_size: int = 4, seq_len: int = 16, **kwargs: Any) -> TextDataModule:
    return TextDataModule(
        corpus="synthetic", seq_len=seq_len, batch_size=batch_size, synthetic_tokens=8192, vocab_size=64, **kwargs
    )


def tiny_trainer(callbacks: list[pl.Callback], max_steps: int = 4, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "log_every_n_steps": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
    }
    # Lightning refuses a ModelCheckpoint (ResumableCheckpoint) with enable_checkpointing=False.
    defaults["enable_checkpointing"] = any(isinstance(cb, pl.callbacks.ModelCheckpoint) for cb in callbacks)
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


class ListLogger(pl.loggers.Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, key: str) -> list[float]:
        return [m[key] for _, m in self.rows if key in m]
