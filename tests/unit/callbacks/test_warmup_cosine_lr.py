from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_trainopt.callbacks import WarmupCosineLR
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.models.lit_gpt import warmup_cosine
from lightning_trainopt.optim.schedules import warmup_cosine_factor
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._foreign import TwoOptimizers


def _loader(n: int = 64) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 4)), batch_size=4)


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


class OneOptimizer(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def test_each_fit_starts_from_its_own_optimizer_lr():
    # The same callback in a second fit must not keep the first fit's peak (1e-3): the module asks for 1e-2.
    cb = WarmupCosineLR(warmup_steps=2, min_lr_ratio=0.1)
    first, second = LrRecorder(), LrRecorder()
    tiny_trainer([cb, first], max_steps=6).fit(OneOptimizer(lr=1e-3), _loader())
    tiny_trainer([cb, second], max_steps=6).fit(OneOptimizer(lr=1e-2), _loader())
    expected = [warmup_cosine_factor(k, 2, 6, 0.1) for k in range(6)]
    assert [r[0] for r in first.lrs] == pytest.approx([1e-3 * f for f in expected], rel=1e-12)
    assert [r[0] for r in second.lrs] == pytest.approx([1e-2 * f for f in expected], rel=1e-12)


def test_manual_optimization_with_two_optimizers_steps_once_per_batch():
    # An epoch of 16 batches: the schedule spans the 16 batches (before: total 16 read against a global_step that
    # reached 32, so the second half of the epoch ran at lr 0).
    cb = WarmupCosineLR(warmup_steps=2)
    module = TwoOptimizers(width=4)
    trainer = tiny_trainer([cb], max_steps=-1, max_epochs=1)
    trainer.fit(module, _loader())
    assert trainer.global_step == 32
    factors = [warmup_cosine_factor(k, 2, 16) for k in range(16)]
    assert [lr for lr, _ in module.lrs] == pytest.approx([0.1 * f for f in factors], rel=1e-12)
    assert [lr for _, lr in module.lrs] == pytest.approx([1e-3 * f for f in factors], rel=1e-12)
    assert module.lrs[-1][0] > 0  # the last batch is still on the cosine, not past its end
    summary = cb.summary()["lr_schedule"]
    assert (summary["total_steps"], summary["step"], summary["unit"]) == (16, 16, "batches_that_stepped")


def test_manual_optimization_resume_continues_the_curve(tmp_path):
    full = TwoOptimizers(width=4)
    tiny_trainer([WarmupCosineLR(warmup_steps=2, total_steps=8)], max_steps=16).fit(full, _loader())
    half = tiny_trainer([WarmupCosineLR(warmup_steps=2, total_steps=8)], max_steps=8)
    half.fit(TwoOptimizers(width=4), _loader())
    ckpt = str(tmp_path / "half.ckpt")
    half.save_checkpoint(ckpt)
    resumed = TwoOptimizers(width=4)
    tiny_trainer([WarmupCosineLR(warmup_steps=2, total_steps=8)], max_steps=16).fit(resumed, _loader(), ckpt_path=ckpt)
    assert len(full.lrs) == 8
    assert resumed.lrs == full.lrs[4:]


def test_manual_optimization_with_two_optimizers_and_max_steps_needs_total_steps():
    # max_steps counts every optimizer.step(): 12 is 6 batches here, 12 with one optimizer; refused, not guessed.
    trainer = tiny_trainer([WarmupCosineLR(warmup_steps=2)], max_steps=12)
    with pytest.raises(ConfigError, match=r"trainer.max_steps=12 counts every optimizer.step\(\)") as err:
        trainer.fit(TwoOptimizers(width=4), _loader())
    assert err.value.key == "callbacks.warmup_cosine_lr.total_steps"
    assert "e.g. 6 if every batch steps all 2 optimizers" in str(err.value)
    module = TwoOptimizers(width=4)
    tiny_trainer([WarmupCosineLR(warmup_steps=2, total_steps=6)], max_steps=12).fit(module, _loader())
    assert [lr for lr, _ in module.lrs] == pytest.approx([0.1 * warmup_cosine_factor(k, 2, 6) for k in range(6)])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"min_lr_ratio": "a"}, "min_lr_ratio"),
        ({"min_lr_ratio": "0.1"}, "min_lr_ratio"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2, "total_steps": 0}, "total_steps"),
    ],
)
def test_bad_arguments_are_refused_in_init(kwargs, key):
    with pytest.raises(ConfigError) as err:
        WarmupCosineLR(**kwargs)
    assert err.value.key == f"callbacks.warmup_cosine_lr.{key}"
    assert err.value.value == kwargs[key]
    assert "is invalid: use" in str(err.value)


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


def test_a_warmup_ratio_gives_the_curve_of_its_whole_steps():
    steps = 8
    ref = LrRecorder()
    tiny_trainer([WarmupCosineLR(warmup_steps=2, min_lr_ratio=0.1), ref], max_steps=steps).fit(
        tiny_module(), tiny_data()
    )
    rec = LrRecorder()
    cb = WarmupCosineLR(warmup_ratio=0.3, min_lr_ratio=0.1)  # 0.3 x 8 = 2.4 -> 2 steps
    tiny_trainer([cb, rec], max_steps=steps).fit(tiny_module(), tiny_data())
    assert [r[0] for r in rec.lrs] == pytest.approx([r[0] for r in ref.lrs], rel=1e-12)
    assert cb.summary()["lr_schedule"]["warmup_steps"] == 2
    assert cb.summary()["lr_schedule"]["warmup_ratio"] == 0.3


def test_the_default_warmup_fits_a_one_step_run():
    rec = LrRecorder()
    cb = WarmupCosineLR()
    tiny_trainer([cb, rec], max_steps=1).fit(tiny_module(), tiny_data())
    assert rec.lrs[0][0] == pytest.approx(3e-4)  # no warmup: the one step runs at the peak
    assert cb.summary()["lr_schedule"]["warmup_steps"] == 0


def test_both_warmups_are_refused_in_init():
    with pytest.raises(ConfigError) as err:
        WarmupCosineLR(warmup_steps=2, warmup_ratio=0.1)
    assert err.value.key == "callbacks.warmup_cosine_lr.warmup_ratio"
    assert "callbacks.warmup_cosine_lr.warmup_steps=2" in str(err.value)


class StepsEveryOtherBatch(pl.LightningModule):
    """Manual optimization that accumulates two batches per step: only odd batches call ``optimizer.step()``.

    Records the learning rate of every batch (``lrs``) and of every step taken (``stepped_lrs``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(4, 1)
        self.lrs: list[float] = []
        self.stepped_lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt = self.optimizers()
        lr = opt.param_groups[0]["lr"]
        self.lrs.append(lr)
        self.manual_backward(self.layer(x).pow(2).mean() / 2)
        if batch_idx % 2 == 1:
            self.stepped_lrs.append(lr)
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_batches_that_do_not_step_do_not_advance_the_schedule():
    # 16 batches, a step on every 2nd: 8 schedule steps. Batches 2k and 2k + 1 both run at step k's factor, so the
    # 8 steps taken see factors 0..7 of the 8-step curve (advancing on every batch would reach the floor by
    # batch 8 and step the second half of the epoch at lr 0).
    cb = WarmupCosineLR(warmup_steps=2, total_steps=8)
    module = StepsEveryOtherBatch()
    trainer = tiny_trainer([cb], max_steps=-1, max_epochs=1)
    trainer.fit(module, _loader())
    assert trainer.global_step == 8
    factors = [warmup_cosine_factor(k, 2, 8) for k in range(8)]
    assert module.stepped_lrs == pytest.approx([0.1 * f for f in factors], rel=1e-12)
    assert module.lrs == pytest.approx([0.1 * factors[b // 2] for b in range(16)], rel=1e-12)
    # Step 0 of 2 warmup steps runs at half the peak, step 2 at the peak itself.
    assert module.stepped_lrs[:3] == pytest.approx([0.05, 0.1, 0.1], rel=1e-12)
    summary = cb.summary()["lr_schedule"]
    assert (summary["step"], summary["unit"]) == (8, "batches_that_stepped")
