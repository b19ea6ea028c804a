"""A callback that holds a SLURM job's first run before a step until SLURM ends it: ``+callbacks.stall.step=N``."""

from __future__ import annotations

import os
import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

MARK = "holding before step"


class HoldUntilTerminated(pl.Callback):
    """On every rank, before step ``step`` of the job's first run: print ``holding before step <step>`` and wait.

    The wait ends when the rank receives SIGTERM (Lightning's ``trainer.received_sigterm``, or ResumableCheckpoint's
    ``stop_requested``), which SLURM sends once the job is requeued, or after ``seconds``. While every rank waits
    here, a test sends the pre-emption signal: the ranks handle it at the same point, between steps. A requeued run
    (``SLURM_RESTART_COUNT`` > 0) does not wait.
    """

    def __init__(self, step: int, seconds: float = 300.0) -> None:
        self.step = step
        self.seconds = seconds

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.step or os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
            return
        print(f"{MARK} {self.step} (rank {trainer.global_rank})", flush=True)
        deadline = time.monotonic() + self.seconds
        # On several processes ResumableCheckpoint holds a SIGTERM for the ranks' agreement (stop_requested) before
        # Lightning's flag is set.
        while not _terminated(trainer) and time.monotonic() < deadline:
            time.sleep(0.2)


def _terminated(trainer: pl.Trainer) -> bool:
    pending = any(getattr(cb, "stop_requested", False) for cb in trainer.callbacks)
    return trainer.received_sigterm or pending
