"""CostMonitor: live dollars spent, dollars per 1B tokens, projection to the end, and dollars lost to idle time."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt.callbacks._common import (
    Clock,
    StepEdge,
    check_log_every,
    default_clock,
    find_callback,
    json_safe,
    log_interval,
    log_metrics,
    warn_off,
)
from lightning_trainopt.core.cost import CostReport, cost_report
from lightning_trainopt.core.hardware import HardwareSpec, hardware_spec
from lightning_trainopt.core.throughput import batch_size_of
from lightning_trainopt.exceptions import ConfigError

__all__ = ["CostMonitor"]


class CostMonitor(Callback):
    """Dollars of the run from the price per device-hour of the ``hardware`` preset.

    Billed time is wall-clock training time (``on_train_start`` to now) times the world size. Idle dollars use
    GPUMonitor's mean utilisation when present, else StepTimer's input-wait share.

    Args:
        hardware: a :class:`HardwareSpec` (``conf/hardware``) or preset name; default ``auto``.
        price_per_device_hour: overrides the preset's price.
        target_tokens: project to this token count instead of ``trainer.max_steps``.
        log_every_n_steps: window in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        clock: seconds since an arbitrary origin (tests inject a fake).

    Example::

        trainer = Trainer(callbacks=[CostMonitor(hardware="a100_80gb", price_per_device_hour=4.1)])
    """

    def __init__(
        self,
        hardware: HardwareSpec | str | None = None,
        price_per_device_hour: float | None = None,
        target_tokens: int | None = None,
        log_every_n_steps: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        if price_per_device_hour is not None and price_per_device_hour < 0:
            raise ConfigError(
                "callbacks.cost_monitor.price_per_device_hour", price_per_device_hour, "use a price >= 0."
            )
        if target_tokens is not None and (not isinstance(target_tokens, int) or target_tokens < 1):
            raise ConfigError("callbacks.cost_monitor.target_tokens", target_tokens, "use a positive token count.")
        check_log_every("callbacks.cost_monitor.log_every_n_steps", log_every_n_steps)
        self.hardware = hardware
        self.price_per_device_hour = price_per_device_hour
        self.target_tokens = target_tokens
        self.log_every_n_steps = log_every_n_steps
        self._clock = clock or default_clock
        self._spec: HardwareSpec | None = None
        self._price: float | None = None
        self._elapsed_before = 0.0
        self._t0: float | None = None
        self._tokens_host = 0
        self._tokens_dev: torch.Tensor | None = None
        self._steps_done = 0
        self._steps_total: int | None = None
        self._devices = 1
        self._edge = StepEdge()
        self._report: CostReport | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        spec = self.hardware
        self._spec = spec if isinstance(spec, HardwareSpec) else hardware_spec(spec or "auto")
        self._price = (
            self.price_per_device_hour if self.price_per_device_hour is not None else self._spec.price_per_device_hour
        )
        if self._price is None:
            warn_off(
                "CostMonitor's dollar figures",
                f"no price per device-hour for {self._spec.name}; set hardware.price_per_device_hour=... "
                f"(device-hours are still reported).",
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = self._clock()
        self._devices = trainer.world_size
        self._edge.reset(trainer)
        self._steps_total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if self._steps_total is None:
            est = trainer.estimated_stepping_batches
            self._steps_total = int(est) if est != float("inf") else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tokens = batch_size_of(batch).tokens
        if isinstance(tokens, torch.Tensor):
            self._tokens_dev = tokens if self._tokens_dev is None else self._tokens_dev + tokens
        else:
            self._tokens_host += tokens

    def _tokens(self) -> int:
        if self._tokens_dev is not None:
            self._tokens_host += int(self._tokens_dev.item())  # only at logging windows
            self._tokens_dev = None
        return self._tokens_host

    def _idle_fraction(self, trainer: pl.Trainer) -> float | None:
        gpu = find_callback(trainer, "GPUMonitor")
        if gpu is not None and gpu.mean_util_pct is not None:
            return max(0.0, 1.0 - gpu.mean_util_pct / 100.0)
        timer = find_callback(trainer, "StepTimer")
        if timer is not None and timer.split.wall > 0:
            f = timer.split.fractions()
            return f.get("data_wait", 0.0) + f.get("h2d", 0.0)
        return None

    def report(self, trainer: pl.Trainer) -> CostReport:
        """The cost so far (all devices), projected to ``target_tokens`` or the run's optimizer steps."""
        elapsed = self._elapsed_before + (self._clock() - self._t0 if self._t0 is not None else 0.0)
        return cost_report(
            elapsed,
            self._devices,
            self._price,
            self._tokens() * self._devices,
            steps_done=self._steps_done,
            steps_total=self._steps_total,
            tokens_target=self.target_tokens,
            idle_fraction=self._idle_fraction(trainer),
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._edge.crossed(trainer):
            return
        step = trainer.global_step
        self._steps_done = step
        if step % log_interval(trainer, self.log_every_n_steps) == 0:
            r = self.report(trainer)
            metrics = {
                "cost/device_hours": r.device_hours,
                "cost/dollars": r.dollars,
                "cost/dollars_per_1b_tokens": r.dollars_per_1b_tokens,
                "cost/projected_total_dollars": r.projected_total_dollars,
                "cost/projected_hours_left": None
                if r.projected_seconds_left is None
                else r.projected_seconds_left / 3600,
            }
            log_metrics(trainer, {k: v for k, v in metrics.items() if v is not None})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps_done = trainer.global_step
        self._report = self.report(trainer)
        if self._t0 is not None:
            self._elapsed_before += self._clock() - self._t0
            self._t0 = None
        r = self._report
        if r.dollars is not None:
            rank_zero_info(
                f"CostMonitor: ${r.dollars:.4f} over {r.device_hours:.4f} device-hours"
                + (f", ${r.dollars_per_1b_tokens:.2f} per 1B tokens" if r.dollars_per_1b_tokens else "")
            )

    def summary(self) -> dict[str, Any]:
        """``{"cost": {device_hours, dollars, dollars_per_1b_tokens, projected_*, idle_fraction, dollars_lost_idle,
        price_per_device_hour, price_source, hardware}}``."""
        out: dict[str, Any] = self._report.to_dict() if self._report else {}
        out["price_per_device_hour"] = self._price
        out["price_source"] = (
            "user-set (price_per_device_hour)"
            if self.price_per_device_hour is not None
            else (self._spec.sources.get("price") if self._spec else None)
        )
        out["hardware"] = self._spec.name if self._spec else None
        return {"cost": json_safe(out)}

    @override
    def state_dict(self) -> dict[str, Any]:
        running = self._clock() - self._t0 if self._t0 is not None else 0.0
        return {"elapsed_s": self._elapsed_before + running, "tokens": self._tokens()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._elapsed_before = float(state_dict["elapsed_s"])
        if self._t0 is not None:  # loaded while training: time from now on adds to the restored figure
            self._t0 = self._clock()
        self._tokens_host = int(state_dict["tokens"])
        self._tokens_dev = None
