import pytest
import torch

from lightning_trainopt.callbacks import NonFiniteGuard
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.lit_gpt import LitGPT
from tests.helpers.tiny_fit import TINY, ListLogger, tiny_data, tiny_trainer


class NaNAt(LitGPT):
    def __init__(self, bad_steps):
        super().__init__(TINY)
        self.bad_steps = set(bad_steps)
        self.snapshots = {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.bad_steps else loss

    def on_train_batch_start(self, batch, batch_idx):
        self.snapshots[self.global_step] = [p.detach().clone() for p in self.parameters()]


def test_skip_leaves_parameters_untouched_and_logs_grad_norm():
    guard = NonFiniteGuard(policy="skip", max_consecutive=2)
    module = NaNAt({2})
    logger = ListLogger()
    with pytest.warns(UserWarning, match="skipping non-finite loss at step 2"):
        tiny_trainer([guard], max_steps=5, logger=logger).fit(module, tiny_data())
    before, after = module.snapshots[2], module.snapshots[3]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not all(torch.equal(a, b) for a, b in zip(module.snapshots[1], module.snapshots[2]))
    assert guard.summary()["non_finite"]["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())
    norms = logger.values("grad_norm")
    assert len(norms) == 4
    assert all(n > 0 for n in norms)


def test_stop_names_the_step():
    guard = NonFiniteGuard(policy="stop")
    trainer = tiny_trainer([guard], max_steps=6)
    with pytest.warns(UserWarning, match="stopped training: non-finite loss at step 1"):
        trainer.fit(NaNAt({1}), tiny_data())
    assert guard.stopped_at == 1
    assert trainer.global_step == 2  # the bad step was skipped, then fit ended


def test_too_many_in_a_row_stops_under_skip():
    guard = NonFiniteGuard(policy="skip", max_consecutive=2)
    trainer = tiny_trainer([guard], max_steps=8)
    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        trainer.fit(NaNAt({1, 2, 3, 4, 5}), tiny_data())
    assert guard.stopped_at == 3
    assert "3 in a row" in guard.stop_reason


def test_bad_policy():
    with pytest.raises(ConfigError, match="policy"):
        NonFiniteGuard(policy="ignore")
