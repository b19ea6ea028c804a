"""ResumableCheckpoint: last.ckpt on its step schedule before the monitored metric exists; a checkpoint on interrupt."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_trainopt.callbacks import ResumableCheckpoint
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer


class SavedSteps(Callback):
    """The global step stored in ``last.ckpt`` after each batch (``None`` while there is none)."""

    def __init__(self, path):
        self.path = path
        self.steps = []

    def on_train_batch_end(self, trainer, *args):
        last = os.path.join(self.path, "last.ckpt")
        self.steps.append(torch.load(last, weights_only=False)["global_step"] if os.path.exists(last) else None)


def _fit(tmp_path, checkpoint_cls, max_steps=6, **trainer_kwargs):
    ckpt = checkpoint_cls(
        dirpath=str(tmp_path),
        filename="step{step}-val{val_loss:.3f}",
        auto_insert_metric_name=False,
        monitor="val_loss",
        save_last=True,
        every_n_train_steps=2,
    )
    probe = SavedSteps(str(tmp_path))
    trainer = tiny_trainer([ckpt, probe], max_steps=max_steps, enable_checkpointing=True, **trainer_kwargs)
    trainer.fit(tiny_module(), datamodule=tiny_data())
    return probe.steps, sorted(os.listdir(tmp_path))


def test_lightnings_checkpoint_saves_nothing_before_the_metric_exists(tmp_path):
    # The defect ResumableCheckpoint exists for: every_n_train_steps waits for val_loss, which never came.
    steps, _ = _fit(tmp_path, ModelCheckpoint)
    assert steps == [None] * 6  # (it writes last.ckpt once the fit has ended: too late for a killed job)


def test_last_follows_every_n_train_steps_before_any_validation(tmp_path):
    steps, files = _fit(tmp_path, ResumableCheckpoint)
    # Lightning runs checkpoint callbacks after all others: the probe at step k sees the saves up to step k - 1.
    assert steps == [None, None, 2, 2, 4, 4]
    assert files == ["last.ckpt"]  # the best-by-val_loss checkpoint waits for a val_loss


def test_a_validation_at_a_saved_step_still_writes_the_best_checkpoint(tmp_path):
    steps, files = _fit(tmp_path, ResumableCheckpoint, limit_val_batches=2, val_check_interval=4)
    assert steps[:4] == [None, None, 2, 2]
    best = [f for f in files if f != "last.ckpt"]
    assert len(best) == 1, files
    assert best[0].startswith("step4-val"), files


class RaiseAt(Callback):
    def __init__(self, step, exc):
        self.step, self.exc = step, exc

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise self.exc


@pytest.mark.parametrize(
    ("exc", "raised", "saved"),
    # Lightning turns a KeyboardInterrupt into sys.exit(1).
    [(KeyboardInterrupt(), SystemExit, True), (RuntimeError("a bug"), RuntimeError, False)],
    ids=["interrupt", "crash"],
)
def test_an_interrupt_saves_where_it_stopped_and_a_crash_does_not(tmp_path, exc, raised, saved):
    ckpt = ResumableCheckpoint(dirpath=str(tmp_path), monitor=None, save_last=False)
    trainer = tiny_trainer([ckpt, RaiseAt(3, exc)], max_steps=10, enable_checkpointing=True)
    with pytest.raises(raised):
        trainer.fit(tiny_module(), datamodule=tiny_data())
    path = tmp_path / "interrupted-step000003.ckpt"
    assert path.exists() is saved
    assert ckpt.interrupt_path == (str(path) if saved else None)
    if saved:
        assert torch.load(path, weights_only=False)["global_step"] == 3


def test_the_first_ctrl_c_stops_at_the_step_boundary_and_restores_the_handler(tmp_path):
    class CtrlC(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    ckpt = ResumableCheckpoint(dirpath=str(tmp_path), monitor=None, save_last=False)
    trainer = tiny_trainer([CtrlC(), ckpt], max_steps=10, enable_checkpointing=True)
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException
        trainer.fit(tiny_module(), datamodule=tiny_data())
    assert trainer.global_step == 2  # stopped at the end of the step the Ctrl-C came in, not later
    assert (tmp_path / "interrupted-step000002.ckpt").exists()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_short_run_without_a_validation_still_ends_with_last_ckpt(tmp_path):
    # Lightning's ModelCheckpoint writes last.ckpt at the end of a fit that saved nothing; so must its subclass.
    ckpt = ResumableCheckpoint(dirpath=str(tmp_path), monitor="val_loss", save_last=True)
    tiny_trainer([ckpt], max_steps=3).fit(tiny_module(), datamodule=tiny_data())
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3


def test_under_accumulation_last_is_written_once_per_scheduled_optimizer_step(tmp_path):
    ckpt = ResumableCheckpoint(dirpath=str(tmp_path), monitor="val_loss", save_last=True, every_n_train_steps=2)
    steps = []
    real_save = ckpt._save_checkpoint
    ckpt._save_checkpoint = lambda trainer, path: (steps.append(trainer.global_step), real_save(trainer, path))
    tiny_trainer([ckpt], max_steps=4, accumulate_grad_batches=3).fit(tiny_module(), datamodule=tiny_data())
    assert steps == [2, 4]  # not once per micro-batch of steps 2 and 4


def test_a_ctrl_c_under_accumulation_stops_after_a_whole_optimizer_step(tmp_path):
    class CtrlCMidStep(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 4:  # the second of three micro-batches of optimizer step 2
                os.kill(os.getpid(), signal.SIGINT)

    ckpt = ResumableCheckpoint(dirpath=str(tmp_path), monitor=None, save_last=False)
    trainer = tiny_trainer([CtrlCMidStep(), ckpt], max_steps=10, accumulate_grad_batches=3)
    with pytest.raises(SystemExit):
        trainer.fit(tiny_module(), datamodule=tiny_data())
    assert trainer.global_step == 2
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == 6  # 2 whole steps of 3 micro-batches
    assert (tmp_path / "interrupted-step000002.ckpt").exists()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"every_n_train_steps": -1}, "every_n_train_steps"),
        ({"every_n_epochs": -2}, "every_n_epochs"),
        ({"every_n_train_steps": 2.5}, "every_n_train_steps"),
        ({"save_top_k": -2}, "save_top_k"),
        ({"mode": "low"}, "mode"),
        ({"save_last": "yes"}, "save_last"),
        ({"every_n_train_steps": 5, "every_n_epochs": 1}, "every_n_epochs"),
        ({"save_top_k": 3, "monitor": None}, "save_top_k"),
        ({"save_on_interrupt": "no"}, "save_on_interrupt"),
        ({"every_n_minutes": 0, "save_last": True}, "every_n_minutes"),
        ({"every_n_minutes": "30", "save_last": True}, "every_n_minutes"),
        ({"every_n_minutes": 30}, "every_n_minutes"),  # without save_last there is no last.ckpt to write
    ],
)
def test_nonsense_arguments_are_config_errors_naming_the_key(tmp_path, kwargs, key):
    from lightning_trainopt.exceptions import ConfigError

    with pytest.raises(ConfigError, match=rf"^callbacks\.model_checkpoint\.{key}="):
        ResumableCheckpoint(dirpath=str(tmp_path), **{"monitor": "val_loss", **kwargs})


def test_every_n_minutes_writes_last_beside_the_step_schedule_even_once_the_metric_exists(tmp_path, monkeypatch):
    from lightning_trainopt.callbacks import resumable_checkpoint
    from tests.unit.callbacks._clock import StepClock

    clock = StepClock(dt=20.0)  # each optimizer step lasts 20 s: a minute is up at steps 3 and 6
    monkeypatch.setattr(resumable_checkpoint, "_clock", clock)
    ckpt = ResumableCheckpoint(
        dirpath=str(tmp_path), monitor="val_loss", save_last=True, every_n_train_steps=4, every_n_minutes=1
    )
    probe = SavedSteps(str(tmp_path))
    # A validation every 2 steps: from step 2 on the metric exists, which stops the step schedule's extra save but
    # must not stop the time one.
    trainer = tiny_trainer(
        [clock, ckpt, probe], max_steps=8, enable_checkpointing=True, limit_val_batches=1, val_check_interval=2
    )
    trainer.fit(tiny_module(), datamodule=tiny_data())
    # The probe at step k sees the saves up to step k - 1 (checkpoint callbacks run last): minutes at 3 and 6, the
    # step schedule at 4 (and 8, after the probe's last look).
    assert probe.steps == [None, None, None, 3, 4, 4, 6, 6]
