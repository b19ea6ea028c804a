"""A test-only callback recording bytes saved for backward per training batch (SavedTensorsCounter)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter, SavedTensorsReport


class SavedProbe(pl.Callback):
    def __init__(self) -> None:
        self.reports: list[SavedTensorsReport] = []
        self._counter: SavedTensorsCounter | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._counter = SavedTensorsCounter(params=pl_module.parameters())
        self._counter.start()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        assert self._counter is not None
        self._counter.stop()
        self.reports.append(self._counter.report())
