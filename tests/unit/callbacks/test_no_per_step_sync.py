"""The monitors never read a tensor back to the host on a step that does not close a logging window.

On a GPU every such read (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``) waits for the device's queue to drain:
a per-step read is what makes Lightning's DeviceStatsMonitor slow. On CPU the reads cost nothing, but they are the
same calls, so counting where they happen here checks the property the GPU overhead depends on.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_trainopt.callbacks import (
    CostMonitor,
    GPUMonitor,
    MemoryBreakdown,
    MemorySnapshot,
    SpeedMonitor,
    StepTimer,
)
from lightning_trainopt.models.gpt import GPT
from tests.helpers.tiny_fit import TINY, tiny_trainer

STEPS, WINDOW = 30, 10
_READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")


class _Batch(pl.Callback):
    """Puts the running batch index where the patched reads can see it (first callback, so it runs first)."""

    index = -1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        _Batch.index = trainer.global_step


class MaskedGPT(pl.LightningModule):
    """Dict batches with an ``attention_mask``: the monitors count tokens as device tensors (padding excluded),
    the path that must not be read back every step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(TINY)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self(ids)
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
        return (per_token * mask.flatten()).sum() / mask.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _masked_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4 * STEPS):
        mask = torch.zeros(16, dtype=torch.long)
        mask[: 4 + i % 12] = 1
        rows.append({"input_ids": torch.randint(0, TINY.vocab_size, (16,), generator=g), "attention_mask": mask})
    return DataLoader(rows, batch_size=4)


def _from_our_callbacks() -> bool:
    frame = sys._getframe(2)  # 0: this function, 1: read(), 2: the code that asked for the value
    for _ in range(8):
        if frame is None:
            return False
        if "/lightning_trainopt/callbacks/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _count_reads(monkeypatch: pytest.MonkeyPatch, monitors: list[pl.Callback]) -> Counter:
    seen: Counter = Counter()
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *a: Any, _f: Any = original, _n: str = name, **k: Any) -> Any:
            if _Batch.index >= 0 and _from_our_callbacks():
                seen[(_Batch.index, _n)] += 1
            return _f(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    trainer = tiny_trainer([_Batch(), *monitors], max_steps=STEPS, log_every_n_steps=WINDOW)
    trainer.fit(MaskedGPT(), _masked_data())
    _Batch.index = -1
    return seen


def test_monitors_read_tensors_only_when_a_window_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match="is off"):  # GPUMonitor and MemorySnapshot switch themselves off on CPU
        seen = _count_reads(
            monkeypatch,
            [StepTimer(), SpeedMonitor(), MemoryBreakdown(), CostMonitor(price_per_device_hour=1.0), GPUMonitor(),
             MemorySnapshot()],
        )  # fmt: skip
    steps_with_reads = sorted({step for step, _ in seen})
    # Batch b runs with global_step == b; a window closes at the end of the batch that makes global_step a multiple
    # of WINDOW (batches 9, 19, 29). There, and only there, SpeedMonitor and CostMonitor each read their device
    # token counter once (measured: {(9, 'item'): 2, (19, 'item'): 2, (29, 'item'): 2}).
    assert steps_with_reads == [w - 1 for w in range(WINDOW, STEPS + 1, WINDOW)], seen
    assert max(seen.values()) <= 2, seen


def test_the_counter_sees_a_per_step_read(monkeypatch: pytest.MonkeyPatch) -> None:
    class Syncs(StepTimer):  # a monitor that reads the loss back every step, like DeviceStatsMonitor syncs
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *a: Any) -> None:
            float(outputs["loss"])
            super().on_train_batch_end(trainer, pl_module, outputs, *a)

    # Defined in this test file, so mark it as ours for the frame check.
    Syncs.on_train_batch_end.__code__ = Syncs.on_train_batch_end.__code__.replace(
        co_filename="/lightning_trainopt/callbacks/_fake_syncing_monitor.py"
    )
    seen = _count_reads(monkeypatch, [Syncs()])
    assert len({step for step, _ in seen}) == STEPS
