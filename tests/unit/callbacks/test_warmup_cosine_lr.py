from functools import partial

import lightning.pytorch as pl
import pytest

from lightning_trainopt.callbacks import WarmupCosineLR
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.models.lit_gpt import warmup_cosine
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer


class LrRecorder(pl.Callback):
    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


def test_same_curve_as_scheduler_warmup_cosine_step_by_step():
    steps = 12
    ref = LrRecorder()
    module = tiny_module(scheduler=partial(warmup_cosine, warmup_steps=3, min_lr_ratio=0.1))
    tiny_trainer([ref], max_steps=steps).fit(module, tiny_data())
    rec = LrRecorder()
    cb = WarmupCosineLR(warmup_steps=3, min_lr_ratio=0.1)
    tiny_trainer([cb, rec], max_steps=steps).fit(tiny_module(), tiny_data())
    assert len(ref.lrs) == len(rec.lrs) == steps
    for a, b in zip(ref.lrs, rec.lrs):
        assert a == pytest.approx(b, rel=1e-12)
    assert rec.lrs[0][0] == pytest.approx(3e-4 / 3)
    assert rec.lrs[-1][0] > 3e-4 * 0.1


def test_resume_from_checkpoint_continues_the_curve(tmp_path):
    full = LrRecorder()
    tiny_trainer([WarmupCosineLR(warmup_steps=2, total_steps=8), full], max_steps=8).fit(tiny_module(), tiny_data())
    trainer = tiny_trainer([WarmupCosineLR(warmup_steps=2, total_steps=8)], max_steps=4)
    trainer.fit(tiny_module(), tiny_data())
    ckpt = str(tmp_path / "half.ckpt")
    trainer.save_checkpoint(ckpt)
    # A fresh callback: the peak comes from the checkpoint, not from the optimizer's decayed learning rate.
    resumed = WarmupCosineLR(warmup_steps=2, total_steps=8)
    rec = LrRecorder()
    tiny_trainer([resumed, rec], max_steps=8).fit(tiny_module(), tiny_data(), ckpt_path=ckpt)
    assert [r[0] for r in rec.lrs] == pytest.approx([r[0] for r in full.lrs[4:]], rel=1e-12)


def test_refuses_warmup_longer_than_the_run():
    with pytest.raises(ConfigError, match="callbacks.warmup_cosine_lr.warmup_steps"):
        WarmupCosineLR(warmup_steps=10, total_steps=10)
    trainer = tiny_trainer([WarmupCosineLR(warmup_steps=5)], max_steps=5)
    with pytest.raises(ConfigError, match="warmup must be shorter than the 5 optimizer steps"):
        trainer.fit(tiny_module(), tiny_data())


def test_refuses_a_second_scheduler():
    module = tiny_module(scheduler=partial(warmup_cosine, warmup_steps=1))
    with pytest.raises(IncompatibleConfigError, match="two learning-rate schedules"):
        tiny_trainer([WarmupCosineLR(warmup_steps=1)], max_steps=3).fit(module, tiny_data())
