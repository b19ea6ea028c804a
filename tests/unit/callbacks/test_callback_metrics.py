"""The monitors' latest figures are in ``trainer.callback_metrics``, so ModelCheckpoint, EarlyStopping and sweepers that
read the Trainer's metrics can use them (as they can Lightning's LearningRateMonitor's)."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from lightning_trainopt.callbacks import (
    CostMonitor,
    MemoryBreakdown,
    NonFiniteGuard,
    SpeedMonitor,
    StepTimer,
    WarmupCosineLR,
)
from tests.helpers.tiny_fit import ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock
from tests.unit.callbacks._foreign import DictClassifier, loader, padded_batches


def test_every_logged_figure_is_in_callback_metrics_with_its_latest_value():
    clock = StepClock(dt=1.0)
    monitors = [
        StepTimer(),
        SpeedMonitor(peak_tflops=1e-6, clock=clock),
        MemoryBreakdown(at_steps=[1, 3]),
        CostMonitor(price_per_device_hour=3.6, clock=clock),
        WarmupCosineLR(),
        NonFiniteGuard(),
    ]
    logger = ListLogger()
    trainer = tiny_trainer([clock, *monitors], max_steps=4, logger=logger, log_every_n_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(tiny_module(), tiny_data())
    prefixes = ("throughput/", "step_time/", "memory/", "cost/", "lr/", "grad_norm")
    latest: dict[str, float] = {}
    for _, row in logger.rows:
        latest.update({k: v for k, v in row.items() if k.startswith(prefixes)})
    assert {k.split("/")[0] for k in latest} == {p.rstrip("/") for p in prefixes}  # every monitor logged
    metrics = trainer.callback_metrics
    for key, value in latest.items():
        assert isinstance(metrics[key], torch.Tensor), key
        assert metrics[key].item() == pytest.approx(value, rel=1e-6), key
    assert metrics["throughput/tokens_per_s"].item() == 64.0  # 4 x 16 tokens per fake second
    assert metrics["cost/dollars"].item() == pytest.approx(4 / 3600 * 3.6)  # 4 fake seconds at $3.6/h


def test_model_checkpoint_keeps_the_fastest_step_by_a_throughput_key(tmp_path):
    # Padded batches of varying real lengths: tokens/s differs from step to step under a fake clock.
    batches = padded_batches(6)
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, warmup_steps=0, clock=clock)
    best = ModelCheckpoint(
        dirpath=tmp_path, monitor="throughput/tokens_per_s", mode="max", every_n_train_steps=1, save_top_k=1
    )
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor, best], max_steps=6, logger=logger)
    trainer.fit(DictClassifier(), loader(batches))
    logged = logger.values("throughput/tokens_per_s")
    assert logged == [float(b["attention_mask"].sum()) for b in batches]
    assert best.best_model_score.item() == max(logged)
    assert best.best_model_path.endswith(f"step={logged.index(max(logged)) + 1}.ckpt")


def test_early_stopping_stops_on_a_throughput_key():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=1, warmup_steps=0, clock=clock)
    stop = EarlyStopping(
        monitor="throughput/tokens_per_s", mode="max", stopping_threshold=30.0, check_on_train_epoch_end=True
    )
    trainer = tiny_trainer([clock, monitor, stop], max_steps=-1, max_epochs=5, limit_train_batches=3)
    trainer.fit(tiny_module(), tiny_data())
    # 64 tokens per 2 s = 32 tokens/s >= 30 at the end of the first epoch.
    assert (trainer.current_epoch, trainer.global_step) == (1, 3)
    assert stop.stopped_epoch == 0
