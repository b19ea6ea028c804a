"""When ``fit`` raises, Lightning skips ``Callback.teardown`` (it calls ``on_exception`` and the Trainer's own
teardown only), so callbacks holding a resource must release it in ``on_exception`` as well. A sweep with
``continue_on_oom`` fits again in the same process, where a leftover sampler thread, saved-tensors hook, allocator
history recording or module wrapper would distort the next run's figures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_trainopt._compat import torch_internals as private
from lightning_trainopt.callbacks import (
    ActivationCheckpointing,
    GPUMonitor,
    MemoryBreakdown,
    MemorySnapshot,
    StepTimer,
)
from lightning_trainopt.metrics.saved_tensors import _STATE
from lightning_trainopt.models.lit_gpt import LitGPT
from lightning_trainopt.transforms.checkpointing import is_checkpointed
from tests.helpers.tiny_fit import TINY, tiny_data, tiny_trainer


class _FailsAtStep1(LitGPT):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return out


class _RecordingSnapshot(MemorySnapshot):
    """MemorySnapshot that believes CUDA is there; the private allocator calls are faked by the test."""

    def setup(self, trainer, pl_module, stage):
        self.enabled = True


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trainopt-gpu-monitor" and t.is_alive()]


def test_resources_are_released_when_fit_raises(monkeypatch, tmp_path):
    history: list[str] = []
    monkeypatch.setattr(private, "start_memory_history", lambda *a, **k: history.append("start"))
    monkeypatch.setattr(private, "stop_memory_history", lambda: history.append("stop"))
    monkeypatch.setattr(private, "dump_memory_snapshot", lambda path: history.append("dump"))
    monkeypatch.setattr(MemorySnapshot, "_oom_report", lambda self, trainer, module: {"advice": ["(test)"]})
    module = _FailsAtStep1(TINY)
    timer = StepTimer()
    ckpt = ActivationCheckpointing(module_classes=["Block"])
    callbacks = [
        MemoryBreakdown(at_steps=[1]),  # its saved-tensors counter is live when step 1 raises
        GPUMonitor(interval_s=0.01, log_every_n_steps=1, reader=lambda: {0: {"util_pct": 50.0}}),
        _RecordingSnapshot(dirpath=str(tmp_path), start_step=None, on_oom=True),
        timer,
        ckpt,
    ]
    trainer = tiny_trainer(callbacks, max_steps=5)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(module, tiny_data())

    assert history == ["start", "dump", "stop"]  # snapshot written, then recording switched off
    deadline = time.monotonic() + 5
    while _sampler_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _sampler_threads() == []
    assert not _STATE.counters
    assert "batch_to_device" not in vars(trainer.strategy)  # StepTimer's timing wrapper removed
    assert timer._patched is None
    assert ckpt.plan is not None
    assert ckpt.plan.wrapped
    assert not any(is_checkpointed(m) for m in module.modules())
