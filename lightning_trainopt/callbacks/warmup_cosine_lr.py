"""WarmupCosineLR: linear warmup then cosine decay, applied to any LightningModule's optimizers from outside."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt.callbacks._common import log_interval, log_metrics
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.optim.schedules import check_warmup_cosine, resolve_warmup_steps, warmup_cosine_factor

__all__ = ["WarmupCosineLR"]

_KEY = "callbacks.warmup_cosine_lr"


class WarmupCosineLR(Callback):
    """Sets every param group's learning rate to ``peak * warmup_cosine_factor(step)`` before each training batch.

    The peak of each group is its learning rate when the fit starts (``configure_optimizers`` runs for every fit, so
    a second fit with another learning rate gets its own curve). When Lightning restores the callback from a
    checkpoint (``ckpt_path``), the checkpoint's peaks, total and position are used instead, so a resumed run
    continues the interrupted curve exactly. The curve is the one of ``scheduler=warmup_cosine``
    (:func:`~lightning_trainopt.optim.schedules.warmup_cosine_factor`).

    The schedule's step is the optimizer step (``global_step``) under automatic optimization. Under manual
    optimization it is the number of training batches in which at least one optimizer stepped, whatever the number
    of optimizers (``global_step`` counts every ``optimizer.step()``, so two optimizers would run the curve twice
    as fast); every optimizer's groups get the same factor. ``total_steps`` is in the same unit.

    Args:
        warmup_steps: steps of linear warmup; shorter than the schedule.
        warmup_ratio: the warmup as a fraction in ``[0, 1)`` of the schedule's steps, rounded down
            (:func:`~lightning_trainopt.optim.schedules.resolve_warmup_steps`). Give at most one of the two; neither:
            :data:`~lightning_trainopt.optim.schedules.DEFAULT_WARMUP_RATIO`, so the default fits a run of any length
            (a run under 30 steps has no warmup).
        total_steps: steps of the whole schedule. Default: ``trainer.estimated_stepping_batches`` (Lightning's
            "batches that will ``optimizer.step()``"). Under manual optimization with several optimizers and a
            ``max_steps`` limit, that estimate counts optimizer steps, not batches, so ``total_steps`` is required.
        min_lr_ratio: floor of the cosine as a fraction of the peak.

    Raises:
        ConfigError: bad values or both warmups (in ``__init__``), ``warmup_steps >= total_steps``, no step limit,
            or the manual-optimization case above (at fit start, before the first batch).
        IncompatibleConfigError: the module also returns an LR scheduler (two schedules would fight), or the
            checkpoint's schedule has other optimizers/param groups than the module.

    Example::

        trainer = Trainer(max_steps=1000, callbacks=[WarmupCosineLR(warmup_ratio=0.1, min_lr_ratio=0.1)])
    """

    def __init__(
        self,
        warmup_steps: int | None = None,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        warmup_ratio: float | None = None,
    ) -> None:
        check_warmup_cosine(warmup_steps, total_steps, min_lr_ratio, prefix=_KEY, warmup_ratio=warmup_ratio)
        self.warmup_steps = warmup_steps
        self.warmup_ratio = warmup_ratio
        self._warmup = 0  # resolved against the total at fit start
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self._total: int | None = total_steps
        self.base_lrs: list[list[float]] | None = None
        self.last_lr: float | None = None
        self._step = 0  # schedule steps taken (manual optimization: training batches that stepped)
        self._manual = False
        self._restored = False
        self._batch_start_global_step = 0
        self._last_logged: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning restores callback state after `setup` (Trainer._run): only a restore of this run counts.
        self._restored = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.lr_scheduler_configs:
            raise IncompatibleConfigError(
                {"callbacks.warmup_cosine_lr": "on", "configure_optimizers": "returns an LR scheduler"},
                "two learning-rate schedules would overwrite each other.",
                "drop the module's scheduler (scheduler=constant) or remove the WarmupCosineLR callback.",
            )
        self._manual = not pl_module.automatic_optimization
        restored, self._restored = self._restored, False
        current = [[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers]
        if restored and self.base_lrs is not None:
            if [len(b) for b in self.base_lrs] != [len(b) for b in current]:
                raise IncompatibleConfigError(
                    {"ckpt_path": "a WarmupCosineLR checkpoint", "configure_optimizers": "other optimizers"},
                    f"the checkpoint's schedule has param groups {[len(b) for b in self.base_lrs]} per optimizer, "
                    f"the module {[len(b) for b in current]}.",
                    "resume with the module's original optimizers, or start a new run without ckpt_path.",
                )
        else:
            self.base_lrs = current
        if self.total_steps is not None:
            self._total = self.total_steps
        elif restored and self._total is not None:
            estimate = trainer.estimated_stepping_batches
            if not self._manual and estimate != self._total:
                rank_zero_info(
                    f"WarmupCosineLR: continuing the checkpoint's schedule of {self._total} steps (this run's estimate "
                    f"is {estimate}); set callbacks.warmup_cosine_lr.total_steps to change it."
                )
        else:
            self._total = self._estimated_total(trainer)
        check_warmup_cosine(
            self.warmup_steps, self._total, self.min_lr_ratio, prefix=_KEY, warmup_ratio=self.warmup_ratio
        )
        self._warmup = resolve_warmup_steps(self.warmup_steps, self.warmup_ratio, self._total)
        if not self._manual:
            self._step = trainer.global_step
        elif not restored and trainer.global_step == 0:
            self._step = 0  # a new run; a continued Trainer or a restored one keeps counting
        self._apply(trainer)

    def _estimated_total(self, trainer: pl.Trainer) -> int:
        est = trainer.estimated_stepping_batches
        if est == float("inf"):
            raise ConfigError(f"{_KEY}.total_steps", None, "the run has no step limit; set total_steps or max_steps.")
        n_opt = len(trainer.optimizers)
        if self._manual and n_opt > 1 and trainer.max_steps != -1:
            raise ConfigError(
                f"{_KEY}.total_steps",
                None,
                f"under manual optimization with {n_opt} optimizers, trainer.max_steps={trainer.max_steps} counts "
                "every optimizer.step(), not training batches, so the schedule's length is unknown; set total_steps "
                f"to the number of training batches that step (e.g. {max(1, trainer.max_steps // n_opt)} if every "
                f"batch steps all {n_opt} optimizers).",
            )
        return int(est)

    def _apply(self, trainer: pl.Trainer) -> None:
        if self.base_lrs is None or self._total is None:
            return
        factor = warmup_cosine_factor(self._step, self._warmup, self._total, self.min_lr_ratio)
        for opt, bases in zip(trainer.optimizers, self.base_lrs):
            for group, base in zip(opt.param_groups, bases):
                group["lr"] = base * factor
        self.last_lr = self.base_lrs[0][0] * factor if self.base_lrs and self.base_lrs[0] else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start_global_step = trainer.global_step
        if not self._manual:
            self._step = trainer.global_step
        self._apply(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._manual:
            self._step = trainer.global_step
        elif trainer.global_step > self._batch_start_global_step:
            self._step += 1

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        if self.last_lr is None or step == self._last_logged or step % log_interval(trainer, None) != 0:
            return
        self._last_logged = step
        log_metrics(trainer, {"lr/warmup_cosine": self.last_lr})

    def summary(self) -> dict[str, Any]:
        """``{"lr_schedule": {...}}``: warmup_steps, warmup_ratio, total_steps, min_lr_ratio, last_lr, step, unit.

        ``warmup_steps`` is the warmup the schedule used (resolved from the ratio against the total); ``step`` is the
        schedule's position; ``unit`` is ``optimizer_steps`` (automatic optimization) or ``batches_that_stepped``
        (manual optimization).
        """
        return {
            "lr_schedule": {
                "warmup_steps": self._warmup,
                "warmup_ratio": self.warmup_ratio,
                "total_steps": self._total,
                "min_lr_ratio": self.min_lr_ratio,
                "last_lr": self.last_lr,
                "step": self._step,
                "unit": "batches_that_stepped" if self._manual else "optimizer_steps",
            }
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": self.base_lrs, "total": self._total, "step": self._step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_lrs = state_dict["base_lrs"]
        self._total = None if state_dict["total"] is None else int(state_dict["total"])
        self._step = int(state_dict["step"])
        self._restored = True
