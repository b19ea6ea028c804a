"""NonFiniteGuard: skip or stop on a NaN/Inf loss or gradient norm, and log the gradient norm."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_trainopt.callbacks._common import log_interval, log_metrics
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError

__all__ = ["NonFiniteGuard"]


def grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """Global L2 norm of the gradients (DTensor shards are reduced to the full norm); ``None`` without gradients."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=None)
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


class NonFiniteGuard(Callback):
    """Watches the loss and the (pre-clipping) gradient norm of every optimizer step.

    With ``policy="skip"`` a non-finite step is skipped: gradients are set to ``None`` so the optimizer leaves
    parameters and states untouched (the LR schedule still advances); more than ``max_consecutive`` skips in a row stop
    the run. With ``policy="stop"`` the first non-finite step stops it. The stop message names the step and, under
    fp16, the loss scale. Under fp16 the loss scaler skips overflowing steps itself; the guard counts those but only
    stops after ``max_consecutive`` of them.

    It reads one scalar per optimizer step (the decision to skip must be taken on the host); that is its only sync.

    Args:
        policy: ``skip`` or ``stop``.
        max_consecutive: non-finite steps in a row tolerated under ``skip`` (and fp16 overflows under either policy).
        log_every_n_steps: gradient-norm logging window (default: the Trainer's ``log_every_n_steps``).

    Example::

        trainer = Trainer(callbacks=[NonFiniteGuard(policy="skip", max_consecutive=3)])
    """

    def __init__(
        self, policy: Literal["skip", "stop"] = "skip", max_consecutive: int = 3, log_every_n_steps: int | None = None
    ) -> None:
        if policy not in ("skip", "stop"):
            raise ConfigError("callbacks.non_finite_guard.policy", policy, "use skip or stop.")
        if not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ConfigError("callbacks.non_finite_guard.max_consecutive", max_consecutive, "use a positive integer.")
        self.policy = policy
        self.max_consecutive = max_consecutive
        self.log_every_n_steps = log_every_n_steps
        self._loss_ok: torch.Tensor | None = None
        self.consecutive = 0
        self.skipped = 0
        self.stopped_at: int | None = None
        self.stop_reason: str | None = None
        self.last_grad_norm: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.policy == "skip" and type(trainer.strategy).__name__.startswith("DeepSpeed"):
            raise IncompatibleConfigError(
                {"callbacks.non_finite_guard.policy": "skip", "strategy": type(trainer.strategy).__name__},
                "DeepSpeed keeps gradients in its own partitions, so the guard cannot drop them to skip a step.",
                "use callbacks.non_finite_guard.policy=stop (DeepSpeed's fp16 loss scaler skips overflows itself).",
            )

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # Kept on the device across micro-batches; read once at the optimizer step.
        finite = torch.isfinite(loss.detach()).all()
        self._loss_ok = finite if self._loss_ok is None else self._loss_ok & finite

    def _loss_scale(self, trainer: pl.Trainer) -> float | None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else None

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        norm = grad_norm(params)
        loss_ok, self._loss_ok = self._loss_ok, None
        checks = [t for t in (loss_ok, None if norm is None else torch.isfinite(norm)) if t is not None]
        if not checks:
            return
        values = torch.stack(
            [c.to(torch.float32).reshape(()) for c in checks]
            + ([norm.detach().float().reshape(()).to(checks[0].device)] if norm is not None else [])
        )
        host = values.tolist()  # the guard's one sync per optimizer step
        ok = all(v == 1.0 for v in host[: len(checks)])
        step = trainer.global_step
        if norm is not None:
            self.last_grad_norm = host[-1]
            if step % log_interval(trainer, self.log_every_n_steps) == 0 and ok:
                log_metrics(trainer, {"grad_norm": host[-1]})
        if ok:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.skipped += 1
        scale = self._loss_scale(trainer)
        fp16_overflow = scale is not None
        what = f"non-finite {'loss' if loss_ok is not None and host[0] != 1.0 else 'gradient norm'} at step {step}"
        scale_note = f" (fp16 loss scale {scale:g})" if scale is not None else ""
        if self.policy == "stop" and not fp16_overflow or self.consecutive > self.max_consecutive:
            self.stopped_at = step
            self.stop_reason = (
                f"NonFiniteGuard stopped training: {what}{scale_note}, {self.consecutive} in a row. "
                "Lower optimizer.lr, raise warmup, set trainer.gradient_clip_val, or use bf16 instead of fp16."
            )
            rank_zero_warn(self.stop_reason)
            trainer.should_stop = True
        else:
            rank_zero_warn(f"NonFiniteGuard: skipping {what}{scale_note} ({self.consecutive} in a row).")
        if not fp16_overflow:
            # Dropping the gradients makes torch optimizers skip every parameter (no state update).
            optimizer.zero_grad(set_to_none=True)

    def summary(self) -> dict[str, Any]:
        """``{"non_finite": {"skipped_steps", "stopped_at_step", "stop_reason", "last_grad_norm"}}``."""
        return {
            "non_finite": {
                "skipped_steps": self.skipped,
                "stopped_at_step": self.stopped_at,
                "stop_reason": self.stop_reason,
                "last_grad_norm": self.last_grad_norm,
            }
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict["skipped"])
        self.consecutive = int(state_dict["consecutive"])
