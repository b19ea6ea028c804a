"""A callback that raises inside ``fit``, as a bug would: ``+callbacks.crash._target_=tests.helpers.crash.CrashAt``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


class CrashAt(pl.Callback):
    """Raise ``RuntimeError`` before training step ``step`` on global rank ``rank`` (every rank when ``None``)."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step = step
        self.rank = rank

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            raise RuntimeError(f"injected crash at step {self.step} on rank {trainer.global_rank}")
