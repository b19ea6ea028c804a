import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_trainopt._compat.torch_internals import RecomputeFlopCounter
from lightning_trainopt.metrics.flops import fit_seq_flops


class _Half(nn.Module):
    """Two linear layers; the first (with its ReLU, whose output backward needs) is checkpointed when ``ckpt``."""

    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU())
        self.b, self.ckpt = nn.Linear(8, 8, bias=False), ckpt

    def forward(self, x):
        x = checkpoint(self.a, x, use_reentrant=False) if self.ckpt else self.a(x)
        return self.b(x)


def _run(model, x):
    counter = RecomputeFlopCounter()
    with counter:
        loss = model(x).sum()
        counter.start_backward()
        loss.backward()
    return counter


def test_counter_splits_forward_backward_and_recompute():
    x = torch.randn(4, 8, requires_grad=True)
    mm = 2 * 4 * 8 * 8
    plain, ckpt = _run(_Half(False), x), _run(_Half(True), x)
    assert (plain.forward, plain.total, plain.recomputed) == (2 * mm, 6 * mm, 0)
    assert (ckpt.forward, ckpt.total, ckpt.recomputed) == (2 * mm, 7 * mm, mm)


def test_without_the_private_hook_recompute_is_unknown_not_zero(monkeypatch):
    # An older torch without FlopCounterMode._count_flops to override: the counter still counts everything, but
    # cannot tell recomputation apart and says so (None); the fit then has no recompute polynomial.
    import lightning_trainopt._compat.torch_internals as private

    monkeypatch.setattr(private, "_count_flops_overridable", lambda: False)
    counter = _run(_Half(True), torch.randn(4, 8, requires_grad=True))
    assert (counter.total, counter.recomputed) == (7 * 2 * 4 * 8 * 8, None)
    fit = fit_seq_flops(_Half(True), torch.zeros(2, 3, 8), samples=2, seq_len=3)
    assert fit.recompute_share is None
    assert fit.hardware(2, 3) == fit(2, 3)


def test_a_sweep_job_after_zero3_gets_torch_linear_back():
    # deepspeed 0.19's zero.Init leaves zero3_linear_wrap in torch.nn.functional after it exits; the teardown between
    # sweep jobs (and the planner's fake-tensor measurement) must not keep it.
    deepspeed = pytest.importorskip("deepspeed")
    from lightning_trainopt._compat.torch_internals import restore_builtin_linear
    from lightning_trainopt.launch.multirun import teardown_distributed

    builtin = torch.nn.functional.linear
    torch.nn.functional.linear = deepspeed.runtime.zero.linear.zero3_linear_wrap  # what an enabled zero.Init leaves
    teardown_distributed()
    assert torch.nn.functional.linear is builtin
    assert restore_builtin_linear() is False
