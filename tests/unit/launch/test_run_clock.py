"""RunClock (train.py's tokens and training seconds for metrics.json) wires hooks to the core window accumulator."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_trainopt.launch.run_clock import RunClock
from lightning_trainopt.parallel.dims import ParallelDims
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock


class ValClock(StepClock):
    """``dt`` seconds per training micro-batch, ``val_dt`` per validation batch (sanity check included)."""

    def __init__(self, dt: float, val_dt: float) -> None:
        super().__init__(dt)
        self.val_dt = val_dt

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.t += self.val_dt


def test_training_seconds_leave_validation_out_and_tokens_count_every_batch():
    clock = ValClock(dt=1.0, val_dt=10.0)
    run = RunClock(clock=clock)
    trainer = tiny_trainer([clock, run], max_steps=6, limit_val_batches=2, val_check_interval=3, num_sanity_val_steps=1)
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    # The sanity check (10 s) and the validations after steps 3 and 6 (20 s each) ran, and are left out.
    assert clock.t == 6 * 1.0 + 10.0 + 2 * 20.0
    assert run.train_seconds == 6.0
    assert run.local_tokens == 6 * 4 * 16
    assert run.last_val_step == 6
    assert run.dims == ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
    trainer.validate(tiny_module(), tiny_data(batch_size=4, seq_len=16))  # after fit: not training time either
    assert run.train_seconds == 6.0
