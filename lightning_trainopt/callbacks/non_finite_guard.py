"""NonFiniteGuard: skip or stop on a NaN/Inf loss or gradient norm, and log the gradient norm."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_trainopt._compat.torch_internals import foreach_norms
from lightning_trainopt.callbacks._common import check_log_every, log_interval, log_metrics
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.parallel.spec import spec_of

__all__ = ["NonFiniteGuard"]

_KEY = "callbacks.non_finite_guard"


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of ``grads`` as torch combines it: DTensor shards reduced to the full norm, any devices."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def read_step(losses: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[list[float], float | None]:
    """The micro-batch losses of one optimizer step and its global gradient L2 norm, read to the host at once.

    Plain gradients on the losses' device (the usual case): one foreach norm per gradient tensor, stacked with the
    losses into one tensor and read once; the norms are combined on the host (``math.hypot`` in float64: no overflow
    where each norm is finite, non-finite exactly when one of them is). No kernel beyond the norms and one stack, no
    Python loop over the gradients. DTensor shards, or gradients the stack refuses (on several devices): torch's
    :func:`total_grad_norm` combines them on the device and it is read with the losses.

    Returns:
        (the losses, the norm or ``None`` without gradients).
    """
    values = [_scalar(t) for t in losses]
    if not grads:
        return (torch.stack(values).tolist() if values else []), None
    if type(grads[0]) is torch.Tensor:  # a DTensor's norm is its shard's: torch reduces it below
        try:
            host = torch.stack([*values, *foreach_norms(grads)]).tolist()  # the one sync of the step
        except RuntimeError:  # several devices, or DTensors: leave it to torch's combination below
            pass
        else:
            return host[: len(values)], math.hypot(*host[len(values) :])
    total = total_grad_norm(grads).detach()
    host = torch.stack([*values, total.to(values[0].device) if values else total]).tolist()
    return host[:-1], host[-1]


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a 0-d tensor that is finite exactly when the loss is (a 0-d loss itself, no kernel).

    A loss of several elements (``manual_backward`` with a gradient) is summed: any NaN or infinity makes the sum
    non-finite; finite elements overflow it only beyond ~3e38, where the gradient norm overflows first anyway.
    """
    if loss.dim() == 0:
        return loss
    return loss.reshape(()) if loss.numel() == 1 else loss.sum()


@dataclass(frozen=True)
class GuardDecision:
    """What the guard does with one optimizer step.

    ``action``: ``ok``; ``overflow`` (fp16: the loss scaler skips the step itself, gradients are left to it);
    ``skip`` (the guard drops the gradients); ``stop`` (drop them, or leave an overflow to the scaler, and stop the
    run). ``what`` names the problem, ``why`` says why an fp16 overflow stops (else empty),
    ``consecutive``/``overflow_streak`` are the streaks after this step.
    """

    action: Literal["ok", "overflow", "skip", "stop"]
    what: str
    consecutive: int
    overflow_streak: int
    why: str = ""


def decide(
    loss_finite: bool,
    grads_finite: bool,
    loss_scale: float | None,
    policy: str,
    consecutive: int,
    overflow_streak: int,
    max_consecutive: int,
    max_overflow_streak: int,
    min_loss_scale: float,
) -> GuardDecision:
    """The guard's policy as a pure function of one optimizer step.

    - Finite loss and gradients: ``ok``; both streaks end.
    - Under fp16 with a loss scaler (``loss_scale`` is the scale this step used), finite loss and non-finite
      gradients is an overflow: normal fp16 behaviour, the scaler skips the step and lowers the scale. It is left
      to the scaler (``overflow``) under either policy, until overflows persist: more than ``max_overflow_streak``
      in a row, or an overflow at a scale at or below ``min_loss_scale`` (the scale cannot usefully fall further;
      DeepSpeed exits there too), which ``stop``.
    - A non-finite loss (any precision), or non-finite gradients without a loss scaler, is a real failure:
      ``stop`` under ``policy="stop"``; under ``policy="skip"`` the step is skipped, and more than
      ``max_consecutive`` in a row ``stop``.

    Args:
        loss_finite: every micro-batch loss of the step was finite (``True`` when none was seen).
        grads_finite: the gradient norm was finite (``True`` without gradients).
        loss_scale: the fp16 loss scaler's scale for this step, ``None`` without a scaler.
        policy: ``skip`` or ``stop``.
        consecutive: guard-skipped steps in a row before this one.
        overflow_streak: fp16 overflow steps in a row before this one.
        max_consecutive: skips in a row tolerated under ``skip``.
        max_overflow_streak: fp16 overflows in a row tolerated.
        min_loss_scale: an overflow at this scale or lower stops.
    """
    if loss_finite and grads_finite:
        return GuardDecision("ok", "", 0, 0)
    if loss_finite and loss_scale is not None:
        streak = overflow_streak + 1
        what = f"fp16 gradient overflow (loss scale {loss_scale:g}, {streak} overflow step(s) in a row)"
        if streak > max_overflow_streak:
            return GuardDecision("stop", what, 0, streak, f"more than max_overflow_streak={max_overflow_streak}")
        if loss_scale <= min_loss_scale:
            why = f"the loss scale is at or below min_loss_scale={min_loss_scale:g}"
            return GuardDecision("stop", what, 0, streak, why)
        return GuardDecision("overflow", what, 0, streak)
    what = f"non-finite {'loss' if not loss_finite else 'gradient norm'}"
    if loss_scale is not None:
        what += f" (fp16 loss scale {loss_scale:g})"
    bad = consecutive + 1
    if policy == "stop" or bad > max_consecutive:
        return GuardDecision("stop", what, bad, 0)
    return GuardDecision("skip", what, bad, 0)


class NonFiniteGuard(Callback):
    """Watches the loss and the (pre-clipping) gradient norm of every optimizer step.

    The policy (:func:`decide`): a non-finite loss, or non-finite gradients outside fp16, is a failure. With
    ``policy="skip"`` the step is skipped (gradients set to ``None`` so the optimizer leaves parameters and states
    untouched; the LR schedule still advances) and more than ``max_consecutive`` in a row stop the run; with
    ``policy="stop"`` the first one stops it. Under fp16 with a loss scaler, non-finite gradients with a finite loss
    are an overflow that the scaler skips by design: the guard lets it, under either policy, unless overflows persist
    (more than ``max_overflow_streak`` in a row, or an overflow at a scale at or below ``min_loss_scale``). Every
    stop message names the step and, under fp16, the loss scale and the overflow streak.

    It reads the step's losses and the gradients' norms back in one transfer per optimizer step (the decision to skip
    must be taken on the host); that is its only sync, plus reading the loss scale on steps that are not finite. The
    gradients are read once, by one foreach norm (:func:`read_step`); the norm is computed afresh because Lightning
    clips after this hook and keeps no norm of its own. Per micro-batch it keeps a reference to the detached loss and
    launches nothing.

    Args:
        policy: ``skip`` or ``stop``.
        max_consecutive: non-finite steps in a row tolerated under ``skip``.
        log_every_n_steps: gradient-norm logging window (default: the Trainer's ``log_every_n_steps``).
        max_overflow_streak: fp16 overflow steps in a row tolerated (either policy).
        min_loss_scale: an fp16 overflow at this loss scale or lower stops the run (either policy).

    Example::

        trainer = Trainer(callbacks=[NonFiniteGuard(policy="skip", max_consecutive=3)])
    """

    def __init__(
        self,
        policy: Literal["skip", "stop"] = "skip",
        max_consecutive: int = 3,
        log_every_n_steps: int | None = None,
        max_overflow_streak: int = 20,
        min_loss_scale: float = 1.0,
    ) -> None:
        if policy not in ("skip", "stop"):
            raise ConfigError(f"{_KEY}.policy", policy, "use skip or stop.")
        for key, value in (("max_consecutive", max_consecutive), ("max_overflow_streak", max_overflow_streak)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{_KEY}.{key}", value, "use a positive integer (optimizer steps in a row).")
        check_log_every(f"{_KEY}.log_every_n_steps", log_every_n_steps)
        number = isinstance(min_loss_scale, (int, float)) and not isinstance(min_loss_scale, bool)
        if not number or not math.isfinite(min_loss_scale) or min_loss_scale < 0:
            raise ConfigError(f"{_KEY}.min_loss_scale", min_loss_scale, "use a number >= 0 (e.g. 1, DeepSpeed's).")
        self.policy = policy
        self.max_consecutive = max_consecutive
        self.log_every_n_steps = log_every_n_steps
        self.max_overflow_streak = max_overflow_streak
        self.min_loss_scale = float(min_loss_scale)
        self._losses: list[torch.Tensor] = []
        self._log_every: int | None = None
        self.consecutive = 0
        self.skipped = 0
        self.overflow_streak = 0
        self.overflow_steps = 0
        self.stopped_at: int | None = None
        self.stop_reason: str | None = None
        self.last_grad_norm: float | None = None
        self.loss_scale: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.policy == "skip" and spec_of(trainer.strategy).wraps_in_engine:
            raise IncompatibleConfigError(
                {"callbacks.non_finite_guard.policy": "skip", "strategy": type(trainer.strategy).__name__},
                "DeepSpeed keeps gradients in its own partitions, so the guard cannot drop them to skip a step.",
                "use callbacks.non_finite_guard.policy=stop (DeepSpeed's fp16 loss scaler skips overflows itself).",
            )

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # Kept on the device across micro-batches and read with the gradient norm at the optimizer step, so a
        # micro-batch costs no kernel. Under fp16 this is the scaled loss (finite exactly when the loss is: fp32 times
        # a finite power of two).
        self._losses.append(loss.detach())

    def _every(self, trainer: pl.Trainer) -> int:
        # Resolved once per fit (on_train_start), not at every step.
        if self._log_every is None:
            self._log_every = log_interval(trainer, self.log_every_n_steps)
        return self._log_every

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_every = log_interval(trainer, self.log_every_n_steps)

    @staticmethod
    def _scaler(trainer: pl.Trainer) -> Any | None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        losses, self._losses = self._losses, []
        if not losses and not grads:
            return
        host, norm = read_step(losses, grads)  # the guard's one sync per optimizer step
        loss_finite = all(math.isfinite(v) for v in host)
        grads_finite = norm is None or math.isfinite(norm)
        step = trainer.global_step
        if norm is not None:
            self.last_grad_norm = norm if grads_finite else None
            if grads_finite and loss_finite and step % self._every(trainer) == 0:
                log_metrics(trainer, {"grad_norm": norm})
        if loss_finite and grads_finite:
            self.consecutive = self.overflow_streak = 0
            return
        scaler = self._scaler(trainer)
        self.loss_scale = float(scaler.get_scale()) if scaler is not None else None
        d = decide(
            loss_finite,
            grads_finite,
            self.loss_scale,
            self.policy,
            self.consecutive,
            self.overflow_streak,
            self.max_consecutive,
            self.max_overflow_streak,
            self.min_loss_scale,
        )
        self.consecutive, self.overflow_streak = d.consecutive, d.overflow_streak
        if d.action == "overflow":
            self.overflow_steps += 1
            if d.overflow_streak == 1:
                rank_zero_info(f"NonFiniteGuard: {d.what} at step {step}; the loss scaler skips it (normal for fp16).")
            return
        if d.overflow_streak:
            self.overflow_steps += 1  # a persistent overflow that stops the run
        else:
            self.skipped += 1
            # Dropping the gradients makes torch optimizers skip every parameter (no state update).
            optimizer.zero_grad(set_to_none=True)
        if d.action == "stop":
            self.stopped_at = step
            detail = f": {d.why}" if d.why else f", {d.consecutive} in a row"
            self.stop_reason = (
                f"NonFiniteGuard stopped training: {d.what} at step {step}{detail}. "
                "Lower optimizer.lr, raise warmup, set trainer.gradient_clip_val, or use bf16 instead of fp16."
            )
            rank_zero_warn(self.stop_reason)
            trainer.should_stop = True
        else:
            rank_zero_warn(f"NonFiniteGuard: skipping {d.what} at step {step} ({d.consecutive} in a row).")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = self._scaler(trainer)
        if scaler is not None:
            self.loss_scale = float(scaler.get_scale())

    def summary(self) -> dict[str, Any]:
        """``{"non_finite": {"skipped_steps", "overflow_steps", "stopped_at_step", "stop_reason", "last_grad_norm",
        "loss_scale"}}``, JSON-safe.

        ``skipped_steps``: steps the guard skipped; ``overflow_steps``: fp16 steps the loss scaler skipped;
        ``last_grad_norm``: the last step's gradient norm (``None`` when it was not finite); ``loss_scale``: the
        fp16 scaler's scale at the end (``None`` without one).
        """
        return {
            "non_finite": {
                "skipped_steps": self.skipped,
                "overflow_steps": self.overflow_steps,
                "stopped_at_step": self.stopped_at,
                "stop_reason": self.stop_reason,
                "last_grad_norm": self.last_grad_norm,
                "loss_scale": self.loss_scale,
            }
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped": self.skipped,
            "consecutive": self.consecutive,
            "overflow_steps": self.overflow_steps,
            "overflow_streak": self.overflow_streak,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict["skipped"])
        self.consecutive = int(state_dict["consecutive"])
        self.overflow_steps = int(state_dict["overflow_steps"])
        self.overflow_streak = int(state_dict["overflow_streak"])
