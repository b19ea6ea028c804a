"""WarmupCosineLR: linear warmup then cosine decay, applied to any LightningModule's optimizers from outside."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_trainopt.callbacks._common import log_interval, log_metrics
from lightning_trainopt.core.schedules import check_warmup_cosine, warmup_cosine_factor
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError

__all__ = ["WarmupCosineLR"]

_KEY = "callbacks.warmup_cosine_lr"


class WarmupCosineLR(Callback):
    """Sets every param group's learning rate to ``peak * warmup_cosine_factor(step)`` before each optimizer step.

    The peak is each group's learning rate when training first starts (kept in the checkpoint, so a resumed run
    continues the same curve). The curve is the one of ``scheduler=warmup_cosine``
    (:func:`~lightning_trainopt.core.schedules.warmup_cosine_factor`).

    Args:
        warmup_steps: optimizer steps of linear warmup.
        total_steps: optimizer steps of the whole schedule (default: ``trainer.estimated_stepping_batches``).
        min_lr_ratio: floor of the cosine as a fraction of the peak.

    Raises:
        ConfigError: ``warmup_steps >= total_steps`` or out-of-range values.
        IncompatibleConfigError: the module also returns an LR scheduler (two schedules would fight).

    Example::

        trainer = Trainer(max_steps=1000, callbacks=[WarmupCosineLR(warmup_steps=100, min_lr_ratio=0.1)])
    """

    def __init__(self, warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.0) -> None:
        if total_steps is not None:
            check_warmup_cosine(warmup_steps, total_steps, min_lr_ratio, prefix=_KEY)
        else:
            if not isinstance(warmup_steps, int) or warmup_steps < 0:
                raise ConfigError(f"{_KEY}.warmup_steps", warmup_steps, "use an integer >= 0.")
            if not 0.0 <= min_lr_ratio <= 1.0:
                raise ConfigError(f"{_KEY}.min_lr_ratio", min_lr_ratio, "use a ratio between 0 and 1.")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self._total: int | None = total_steps
        self.base_lrs: list[list[float]] | None = None
        self.last_lr: float | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.lr_scheduler_configs:
            raise IncompatibleConfigError(
                {"callbacks.warmup_cosine_lr": "on", "configure_optimizers": "returns an LR scheduler"},
                "two learning-rate schedules would overwrite each other.",
                "drop the module's scheduler (scheduler=constant) or remove the WarmupCosineLR callback.",
            )
        if self.total_steps is None:
            est = trainer.estimated_stepping_batches
            if est == float("inf"):
                raise ConfigError(
                    f"{_KEY}.total_steps", None, "the run has no step limit; set total_steps or max_steps."
                )
            self._total = int(est)
        check_warmup_cosine(self.warmup_steps, int(self._total or 0), self.min_lr_ratio, prefix=_KEY)
        if self.base_lrs is None:
            self.base_lrs = [[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers]
        self._apply(trainer, trainer.global_step)

    def _apply(self, trainer: pl.Trainer, step: int) -> None:
        assert self.base_lrs is not None
        assert self._total is not None
        factor = warmup_cosine_factor(step, self.warmup_steps, self._total, self.min_lr_ratio)
        for opt, bases in zip(trainer.optimizers, self.base_lrs):
            for group, base in zip(opt.param_groups, bases):
                group["lr"] = base * factor
        self.last_lr = self.base_lrs[0][0] * factor if self.base_lrs and self.base_lrs[0] else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.base_lrs is not None:
            self._apply(trainer, trainer.global_step)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        if self.base_lrs is not None and self.last_lr is not None and step % log_interval(trainer, None) == 0:
            log_metrics(trainer, {"lr/warmup_cosine": self.last_lr})

    def summary(self) -> dict[str, Any]:
        """``{"lr_schedule": {"warmup_steps", "total_steps", "min_lr_ratio", "last_lr"}}``."""
        return {
            "lr_schedule": {
                "warmup_steps": self.warmup_steps,
                "total_steps": self._total,
                "min_lr_ratio": self.min_lr_ratio,
                "last_lr": self.last_lr,
            }
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": self.base_lrs, "total": self._total}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_lrs = state_dict["base_lrs"]
        if self.total_steps is None and state_dict.get("total") is not None:
            self._total = int(state_dict["total"])
