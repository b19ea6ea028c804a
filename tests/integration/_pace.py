"""A callback that makes every training step last at least ``seconds`` (a sleep; the arithmetic is untouched), so
that a test's kill at a random moment lands among steps and checkpoint writes rather than after the end."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


class Pace(pl.Callback):
    """Sleep ``seconds`` before each training batch: ``+callbacks.pace._target_=tests.integration._pace.Pace``."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds = seconds

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        time.sleep(self.seconds)
