"""Internal callback that counts the tokens this run trained on and the time spent in training steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_trainopt.metrics.throughput import TrainingWindow
from lightning_trainopt.parallel.dims import ParallelDims

__all__ = ["RunClock"]


def batch_tokens(batch: Any) -> int:
    """Tokens in an ``(inputs, targets)`` or ``{input_ids, ...}`` batch (padding included), from its shape only (no
    device sync)."""
    if isinstance(batch, dict):
        return int(batch["input_ids"].numel())
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(inputs.numel())


class RunClock(pl.Callback):
    """Counts tokens and wall time of training (validation excluded), for metrics.json.

    The accounting is :class:`~lightning_trainopt.metrics.throughput.TrainingWindow`'s, opened at the start of training
    and paused for validation; shapes are read on the host, so nothing here synchronises the device per step.
    The run's :class:`ParallelDims` are read from the Trainer when training starts (:attr:`dims`), which also checks
    the strategy's sampler sharding against its layout before the first step.

    Args:
        clock: seconds since an arbitrary origin (default ``time.perf_counter``; tests inject a fake).
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.last_val_step: int | None = None
        #: The run's parallel layout, read at the start of training (``None`` before).
        self.dims: ParallelDims | None = None
        self._window = TrainingWindow(clock) if clock is not None else TrainingWindow()

    @property
    def local_tokens(self) -> int:
        """Tokens of the training batches of this process."""
        return int(self._window.counts().tokens or 0)

    @property
    def train_seconds(self) -> float:
        """Seconds spent training, validation left out."""
        return self._window.seconds()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.dims = ParallelDims.from_trainer(trainer)
        self._window.start()
        self._window.resume()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._window.add(samples=None, tokens=batch_tokens(batch))

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_val_step = trainer.global_step
        if trainer.state.fn == TrainerFn.FITTING:
            self._window.resume()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window.pause()
