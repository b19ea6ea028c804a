"""A callback that stalls a run before a step, where a test SIGKILLs it: ``+callbacks.stall.step=N``."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

MARK = "stalled before step"


class StallAt(pl.Callback):
    """Print ``stalled before step <step>`` and sleep ``seconds`` before that training step, on every rank.

    Step ``step``'s checkpoints (``every_n_train_steps=step`` and a validation at that step) are written by then, so a
    kill during the stall is a preemption right after them, at a known step.
    """

    def __init__(self, step: int, seconds: float = 600.0) -> None:
        self.step = step
        self.seconds = seconds

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            print(f"{MARK} {self.step} (rank {trainer.global_rank})", flush=True)
            time.sleep(self.seconds)
