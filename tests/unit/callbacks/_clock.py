"""A fake clock that a helper callback advances by a fixed amount at every micro-batch end."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class StepClock(pl.Callback):
    """Put it *before* the callback under test: each micro-batch then lasts exactly ``dt`` seconds."""

    def __init__(self, dt: float = 2.0) -> None:
        self.t = 0.0
        self.dt = dt

    def __call__(self) -> float:
        return self.t

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.t += self.dt
