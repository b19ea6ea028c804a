import json
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_trainopt.callbacks import NonFiniteGuard
from lightning_trainopt.callbacks.non_finite_guard import decide
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.lit_gpt import LitGPT
from tests.helpers.runif import RunIf
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


# ---- the policy as a pure function ---------------------------------------------------------------------------------

LIMITS = {"max_consecutive": 2, "max_overflow_streak": 3, "min_loss_scale": 1.0}


@pytest.mark.parametrize(
    ("loss_finite", "grads_finite", "scale", "policy", "streaks", "expected"),
    [
        # healthy step: both streaks end
        (True, True, 1024.0, "stop", (1, 2), ("ok", 0, 0)),
        # fp16 overflow (finite loss, inf gradients): the scaler's business under either policy
        (True, False, 1024.0, "stop", (0, 0), ("overflow", 0, 1)),
        (True, False, 1024.0, "skip", (0, 2), ("overflow", 0, 3)),
        # ... until it persists: a 4th in a row (> 3), or an overflow at a scale at or below the floor
        (True, False, 1024.0, "skip", (0, 3), ("stop", 0, 4)),
        (True, False, 1.0, "skip", (0, 0), ("stop", 0, 1)),
        # a non-finite loss is a failure under fp16 too
        (False, False, 1024.0, "stop", (0, 0), ("stop", 1, 0)),
        (False, True, 1024.0, "skip", (0, 2), ("skip", 1, 0)),
        # without a scaler, non-finite gradients are a failure
        (True, False, None, "stop", (0, 0), ("stop", 1, 0)),
        (True, False, None, "skip", (1, 0), ("skip", 2, 0)),
        (True, False, None, "skip", (2, 0), ("stop", 3, 0)),
    ],
)
def test_decide(loss_finite, grads_finite, scale, policy, streaks, expected):
    d = decide(loss_finite, grads_finite, scale, policy, *streaks, **LIMITS)
    assert (d.action, d.consecutive, d.overflow_streak) == expected


def test_decide_names_the_loss_scale_state():
    d = decide(True, False, 1024.0, "stop", 0, 3, **LIMITS)
    assert d.what == "fp16 gradient overflow (loss scale 1024, 4 overflow step(s) in a row)"
    assert d.why == "more than max_overflow_streak=3"
    assert decide(True, False, 0.5, "stop", 0, 0, **LIMITS).why == "the loss scale is at or below min_loss_scale=1"
    assert decide(False, True, 65536.0, "stop", 0, 0, **LIMITS).what == "non-finite loss (fp16 loss scale 65536)"
    assert decide(True, False, None, "stop", 0, 0, **LIMITS).what == "non-finite gradient norm"


# ---- fp16 on CPU: Lightning's MixedPrecision with a real GradScaler ----------------------------------------------


class InfGrad(torch.autograd.Function):
    """Identity forward; backward returns infinite gradients (an fp16 overflow, with a finite loss)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Fp16Module(pl.LightningModule):
    def __init__(self, overflow_steps=(), nan_loss_steps=()) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.overflow_steps, self.nan_loss_steps = set(overflow_steps), set(nan_loss_steps)
        self.weights: dict[int, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        self.weights[self.global_step] = self.layer.weight.detach().clone()
        (x,) = batch
        out = self.layer(x)
        if self.global_step in self.overflow_steps:
            out = InfGrad.apply(out)
        loss = out.float().pow(2).mean()
        return loss * float("nan") if self.global_step in self.nan_loss_steps else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fp16_fit(guard, module, init_scale=1024.0, max_steps=8, device="cpu"):
    # At the default scale of 65536 this module's gradients overflow fp16 on their own at step 0 (a real, normal
    # overflow); 1024 keeps the injected ones the only ones.
    plugin = MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, init_scale=init_scale))
    accelerator = "gpu" if device == "cuda" else "cpu"
    trainer = tiny_trainer([guard], max_steps=max_steps, plugins=[plugin], accelerator=accelerator)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4))
    return trainer


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=RunIf(min_cuda_gpus=1))])
def test_fp16_overflows_are_left_to_the_scaler_under_stop(device):
    guard = NonFiniteGuard(policy="stop")
    module = Fp16Module(overflow_steps={2, 3})
    trainer = _fp16_fit(guard, module, device=device)
    assert trainer.global_step == 8  # not stopped
    s = guard.summary()["non_finite"]
    assert (s["overflow_steps"], s["skipped_steps"], s["stopped_at_step"]) == (2, 0, None)
    assert s["loss_scale"] == 1024.0 / 4  # halved by each overflow, no growth within 2000 steps
    assert torch.equal(module.weights[2], module.weights[4])  # the scaler skipped both updates
    assert not torch.equal(module.weights[1], module.weights[2])
    json.dumps(guard.summary(), allow_nan=False)


def test_fp16_persistent_overflows_stop_with_the_loss_scale_state():
    guard = NonFiniteGuard(policy="skip", max_overflow_streak=3)
    with pytest.warns(UserWarning, match=r"fp16 gradient overflow \(loss scale 128, 4 overflow step\(s\) in a row\) "):
        trainer = _fp16_fit(guard, Fp16Module(overflow_steps=range(1, 8)))
    assert guard.stopped_at == 4
    assert trainer.global_step == 5
    assert guard.stop_reason.startswith(
        "NonFiniteGuard stopped training: fp16 gradient overflow (loss scale 128, 4 overflow step(s) in a row) "
        "at step 4: more than max_overflow_streak=3."
    )
    # The same overflows from a small scale reach the floor first: an overflow at scale 1 stops.
    floor = NonFiniteGuard(policy="stop")
    with pytest.warns(UserWarning, match="at step 2: the loss scale is at or below min_loss_scale=1"):
        _fp16_fit(floor, Fp16Module(overflow_steps=range(8)), init_scale=4.0)
    assert floor.stopped_at == 2
    assert floor.summary()["non_finite"]["overflow_steps"] == 3


def test_fp16_non_finite_loss_stops_at_once_under_stop():
    # The loss itself is NaN under fp16: `stop` must not treat it as an overflow and train on.
    guard = NonFiniteGuard(policy="stop")
    with pytest.warns(UserWarning, match=r"stopped training: non-finite loss \(fp16 loss scale 1024\) at step 3"):
        trainer = _fp16_fit(guard, Fp16Module(nan_loss_steps={3}))
    assert guard.stopped_at == 3
    assert trainer.global_step == 4


# ---- summary and arguments -------------------------------------------------------------------------------------


def test_summary_is_strict_json_after_a_non_finite_last_step():
    # A NaN gradient norm at the last step must not reach metrics.json as a bare NaN.
    guard = NonFiniteGuard(policy="skip")
    with pytest.warns(UserWarning, match="skipping non-finite loss at step 3"):
        tiny_trainer([guard], max_steps=4).fit(NaNAt({3}), tiny_data())
    s = guard.summary()
    assert s["non_finite"]["last_grad_norm"] is None
    assert s["non_finite"]["loss_scale"] is None
    assert json.loads(json.dumps(s, allow_nan=False)) == s


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"log_every_n_steps": -3}, "log_every_n_steps"),
        ({"log_every_n_steps": "5"}, "log_every_n_steps"),
        ({"max_consecutive": 0}, "max_consecutive"),
        ({"max_consecutive": True}, "max_consecutive"),
        ({"max_overflow_streak": 0}, "max_overflow_streak"),
        ({"min_loss_scale": "1"}, "min_loss_scale"),
        ({"min_loss_scale": -1.0}, "min_loss_scale"),
        ({"min_loss_scale": float("nan")}, "min_loss_scale"),
    ],
)
def test_bad_arguments_are_refused_in_init(kwargs, key):
    with pytest.raises(ConfigError) as err:
        NonFiniteGuard(**kwargs)
    assert err.value.key == f"callbacks.non_finite_guard.{key}"
    assert "is invalid: use" in str(err.value)


class NaNMicroBatch(LitGPT):
    """A NaN loss in one micro-batch (``batch_idx``) that is not the last of its optimizer step."""

    def __init__(self, bad_batch):
        super().__init__(TINY)
        self.bad_batch = bad_batch

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == self.bad_batch else loss


class _CountOps(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _CountingGuard(NonFiniteGuard):
    """Records the torch calls of each per-micro-batch hook and of each optimizer-step hook."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.micro_batch_ops, self.step_ops = [], []

    def on_before_backward(self, trainer, pl_module, loss):
        with _CountOps() as ops:
            super().on_before_backward(trainer, pl_module, loss)
        self.micro_batch_ops.append(ops.names)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with _CountOps() as ops:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.step_ops.append(ops.names)


def test_a_bad_micro_batch_is_caught_at_its_step_with_one_read_and_no_kernel_per_micro_batch():
    guard = _CountingGuard(policy="skip", max_consecutive=3)
    # Accumulation 3: micro-batch 4 is the second of step 1; the step's other two micro-batches are finite.
    trainer = tiny_trainer([guard], max_steps=3, accumulate_grad_batches=3)
    with pytest.warns(UserWarning, match="skipping non-finite loss at step 1"):
        trainer.fit(NaNMicroBatch(bad_batch=4), tiny_data())
    assert guard.skipped == 1
    assert len(guard.micro_batch_ops) == 9
    assert len(guard.step_ops) == 3
    # Per micro-batch only a detach (no isfinite, no logical and: nothing queued on a device).
    assert all(names == ["detach"] for names in guard.micro_batch_ops), guard.micro_batch_ops
    # Per optimizer step exactly one read back to the host, of the three losses and the norm together.
    assert all(names.count("tolist") == 1 for names in guard.step_ops), guard.step_ops
    # The finiteness checks are made on the host, on the values read (no isfinite/all kernels on the device).
    assert not {"isfinite", "all", "__and__", "logical_and"} & {n for names in guard.step_ops for n in names}


def test_scalar_loss_keeps_finiteness_without_a_kernel_for_a_0d_loss():
    from lightning_trainopt.callbacks.non_finite_guard import _scalar

    loss = torch.tensor(2.5)
    assert _scalar(loss) is loss
    assert _scalar(torch.tensor([2.5])).shape == ()
    assert _scalar(torch.tensor([1.0, 2.0])).item() == 3.0
    assert not torch.isfinite(_scalar(torch.tensor([1.0, float("nan")])))
    assert not torch.isfinite(_scalar(torch.tensor([float("inf"), float("-inf")])))


# ---- the step's read-back: per-tensor norms combined on the host ----------------------------------------------------


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 32, generator=g), torch.randn(32, generator=g) * 1e3, torch.randn(7, 5, generator=g)]


def test_read_step_gives_the_losses_and_torchs_total_norm_in_one_read():
    from lightning_trainopt.callbacks.non_finite_guard import read_step

    grads = _grads()
    with _CountOps() as ops:
        losses, norm = read_step([torch.tensor(2.5), torch.tensor([1.0, 2.0])], grads)
    assert losses == [2.5, 3.0]
    expected = torch.nn.utils.get_total_norm([g.double() for g in grads]).item()
    assert norm == pytest.approx(expected, rel=1e-6)
    assert ops.names.count("tolist") == 1
    assert "vector_norm" not in ops.names  # the norms are combined on the host, not by another kernel


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_read_step_norm_is_non_finite_when_one_gradient_element_is(bad):
    from lightning_trainopt.callbacks.non_finite_guard import read_step

    grads = _grads()
    grads[2][3, 1] = bad
    losses, norm = read_step([torch.tensor(1.0)], grads)
    assert losses == [1.0]
    assert not math.isfinite(norm)


def test_read_step_combines_the_norms_without_an_fp32_overflow():
    from lightning_trainopt.callbacks.non_finite_guard import read_step

    # Each tensor's norm (1.5e19, its square 2.25e38) is finite in fp32, and so is the total (2.1e19), but the sum of
    # the squares (4.5e38) is not: torch's fp32 combination calls these gradients non-finite, the host's hypot does not.
    grads = [torch.full((1,), 1.5e19), torch.full((1,), 1.5e19)]
    assert not torch.isfinite(torch.nn.utils.get_total_norm(grads))
    _, norm = read_step([], grads)
    assert norm == pytest.approx(1.5e19 * math.sqrt(2), rel=1e-6)


def test_read_step_leaves_tensor_subclasses_to_torchs_total_norm():
    from lightning_trainopt.callbacks.non_finite_guard import read_step

    # A DTensor's per-tensor norm would be its own shard's: any gradient that is not a plain tensor takes torch's
    # get_total_norm (which reduces shards), and its result is read with the losses.
    grads = [torch.nn.Parameter(g, requires_grad=False) for g in _grads()]
    with _CountOps() as ops:
        losses, norm = read_step([torch.tensor(0.5)], grads)
    assert losses == [0.5]
    assert norm == pytest.approx(torch.nn.utils.get_total_norm([g.detach() for g in grads]).item(), rel=1e-6)
    assert ops.names.count("tolist") == 1


def test_read_step_without_gradients_reads_the_losses_alone():
    from lightning_trainopt.callbacks.non_finite_guard import read_step

    assert read_step([torch.tensor(1.5)], []) == ([1.5], None)
