"""CostMonitor: live dollars spent, dollars per 1B tokens, projection to the end, and dollars lost to idle time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt.callbacks._common import (
    BatchSizer,
    Clock,
    StepEdge,
    check_callable,
    check_hardware,
    check_log_every,
    check_number,
    check_whole,
    default_clock,
    find_callback,
    json_safe,
    log_interval,
    log_metrics,
    warn_off,
)
from lightning_trainopt.core.cost import CostReport, cost_report
from lightning_trainopt.core.hardware import HardwareSpec, hardware_spec

__all__ = ["CostMonitor"]

_KEY = "callbacks.cost_monitor"


class CostMonitor(Callback):
    """Dollars of the run from the price per device-hour of the ``hardware`` preset.

    Billed time is wall-clock training time (``on_train_start`` to now) times the world size. Idle dollars use
    GPUMonitor's mean utilisation when present, else StepTimer's input-wait share. Tokens and samples are counted
    like SpeedMonitor counts them (shapes, an attention mask's sum, or ``tokens_fn``/``samples_fn``); batches it cannot
    size leave out the per-token and per-sample figures (one warning) while dollars and hours are still reported.

    Args:
        hardware: a :class:`HardwareSpec` (``conf/hardware``) or preset name; default ``auto``.
        price_per_device_hour: overrides the preset's price.
        target_tokens: project to this token count instead of ``trainer.max_steps`` (a whole number; ``1e9`` works).
        log_every_n_steps: window in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        samples_fn: ``batch -> int`` samples of a micro-batch (default: inferred from shapes).
        tokens_fn: ``batch -> int | Tensor`` tokens of a micro-batch (default: shapes, or an attention mask's sum).
        clock: seconds since an arbitrary origin (tests inject a fake).

    Raises:
        ConfigError: an argument of the wrong type or range (e.g. ``price_per_device_hour="abc"``), or an unknown
            preset name.

    Example::

        trainer = Trainer(callbacks=[CostMonitor(hardware="a100_80gb", price_per_device_hour=4.1)])
    """

    def __init__(
        self,
        hardware: HardwareSpec | str | None = None,
        price_per_device_hour: float | None = None,
        target_tokens: int | float | None = None,
        log_every_n_steps: int | None = None,
        samples_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], Any] | None = None,
        clock: Clock | None = None,
    ) -> None:
        check_hardware(f"{_KEY}.hardware", hardware)
        check_number(f"{_KEY}.price_per_device_hour", price_per_device_hour, low=0.0)
        check_log_every(f"{_KEY}.log_every_n_steps", log_every_n_steps)
        check_callable(f"{_KEY}.samples_fn", samples_fn)
        check_callable(f"{_KEY}.tokens_fn", tokens_fn)
        self.hardware = hardware
        self.price_per_device_hour = price_per_device_hour
        self.target_tokens = check_whole(f"{_KEY}.target_tokens", target_tokens, minimum=1)
        self.log_every_n_steps = log_every_n_steps
        self.samples_fn = samples_fn
        self.tokens_fn = tokens_fn
        self._clock = clock or default_clock
        self._spec: HardwareSpec | None = None
        self._price: float | None = None
        self._elapsed_before = 0.0
        self._t0: float | None = None
        self._tokens_host: int | None = 0
        self._tokens_dev: torch.Tensor | None = None
        self._samples: int | None = 0
        self._sizer = BatchSizer(
            "CostMonitor", samples_fn, tokens_fn, "its per-token and per-sample figures are left out"
        )
        self._logged_step = -1
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
        self._logged_step = -1
        self._steps_total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if self._steps_total is None:
            est = trainer.estimated_stepping_batches
            self._steps_total = int(est) if est != float("inf") else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        count = self._sizer(batch)
        self._samples = None if self._samples is None or count.samples is None else self._samples + count.samples
        tokens = count.tokens
        if tokens is None:
            self._tokens_host, self._tokens_dev = None, None
        elif self._tokens_host is None:
            pass  # a batch was not sized: the token count stays unknown for the run
        elif isinstance(tokens, torch.Tensor):
            self._tokens_dev = tokens if self._tokens_dev is None else self._tokens_dev + tokens
        else:
            self._tokens_host += tokens

    def _tokens(self) -> int | None:
        if self._tokens_dev is not None and self._tokens_host is not None:
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
        tokens = self._tokens()
        return cost_report(
            elapsed,
            self._devices,
            self._price,
            None if tokens is None else tokens * self._devices,
            steps_done=self._steps_done,
            steps_total=self._steps_total,
            tokens_target=self.target_tokens,
            idle_fraction=self._idle_fraction(trainer),
            samples=None if self._samples is None else self._samples * self._devices,
        )

    def _log(self, trainer: pl.Trainer, r: CostReport) -> None:
        metrics = {
            "cost/device_hours": r.device_hours,
            "cost/dollars": r.dollars,
            "cost/dollars_per_1b_tokens": r.dollars_per_1b_tokens,
            "cost/dollars_per_1m_samples": r.dollars_per_1m_samples,
            "cost/projected_total_dollars": r.projected_total_dollars,
            "cost/projected_hours_left": None if r.projected_seconds_left is None else r.projected_seconds_left / 3600,
        }
        log_metrics(trainer, {k: v for k, v in metrics.items() if v is not None})
        self._logged_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._edge.crossed(trainer):
            return
        step = trainer.global_step
        self._steps_done = step
        if step % log_interval(trainer, self.log_every_n_steps) == 0:
            self._log(trainer, self.report(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps_done = trainer.global_step
        self._report = self.report(trainer)
        if self._logged_step != trainer.global_step:  # a run shorter than the window still logs its cost once
            self._log(trainer, self._report)
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
        """``{"cost": {device_hours, dollars, dollars_per_1b_tokens, dollars_per_1m_samples, projected_*,
        idle_fraction, dollars_lost_idle, tokens, samples, price_per_device_hour, price_source, hardware}}``."""
        out: dict[str, Any] = self._report.to_dict() if self._report else {}
        out["tokens"] = None if self._tokens_host is None else self._tokens_host * self._devices
        out["samples"] = None if self._samples is None else self._samples * self._devices
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
        return {"elapsed_s": self._elapsed_before + running, "tokens": self._tokens(), "samples": self._samples}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._elapsed_before = float(state_dict["elapsed_s"])
        if self._t0 is not None:  # loaded while training: time from now on adds to the restored figure
            self._t0 = self._clock()
        tokens, samples = state_dict["tokens"], state_dict.get("samples", 0)
        self._tokens_host = None if tokens is None else int(tokens)
        self._tokens_dev = None
        self._samples = None if samples is None else int(samples)
