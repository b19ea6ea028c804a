"""Internal callback that counts the tokens this run trained on and the time spent in training steps."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["RunClock"]


def batch_tokens(batch: Any) -> int:
    """Tokens in a ``(inputs, targets)`` batch, from its shape only (no device sync)."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(inputs.numel())


class RunClock(pl.Callback):
    """Counts tokens and wall time of training (validation excluded), for metrics.json.

    Shapes are read on the host, so nothing here synchronises the device per step.
    """

    def __init__(self) -> None:
        self.local_tokens = 0
        self.train_seconds = 0.0
        self.last_val_step: int | None = None
        self._t: float | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.local_tokens += batch_tokens(batch)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t is not None:
            self.train_seconds += time.perf_counter() - self._t
            self._t = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_val_step = trainer.global_step
        if trainer.state.fn == TrainerFn.FITTING:
            self._t = time.perf_counter()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t is not None:
            self.train_seconds += time.perf_counter() - self._t
            self._t = None
