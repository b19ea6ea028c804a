"""CostMonitor: live dollars spent, dollars per 1B tokens, projection to the end, and dollars lost to idle time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt.callbacks._common import (
    BatchSizer,
    Clock,
    FitRestore,
    StepEdge,
    check_counting_args,
    check_number,
    check_whole,
    default_clock,
    find_callback,
    json_safe,
    log_metrics,
    resolve_hardware,
    warn_off,
)
from lightning_trainopt.metrics.cost import CostReport, cost_report
from lightning_trainopt.metrics.hardware import HardwareSpec
from lightning_trainopt.metrics.throughput import TrainingWindow
from lightning_trainopt.parallel.dims import ParallelDims

__all__ = ["CostMonitor"]

_KEY = "callbacks.cost_monitor"


def _plus(before: int | None, per_rank: int | None, replicas: int) -> int | None:
    """Earlier runs' count plus one rank's count of the current run on every data-parallel replica; unknown if
    either is."""
    return None if before is None or per_rank is None else before + per_rank * replicas


class CostMonitor(Callback):
    """Dollars of the run from the price per device-hour of the ``hardware`` preset.

    Billed time is wall-clock training time (``on_train_start`` to now) times the world size (every device is paid
    for); tokens and samples are one rank's counts times the data-parallel size
    (:class:`~lightning_trainopt.parallel.dims.ParallelDims`), since the ranks of a tensor-parallel group read the
    same micro-batches. A resume adds to the
    checkpoint's device-hours and tokens, which keep the world size they were run on: only the new run's time is
    billed at the new world size, and the projection (to ``max_steps`` or ``target_tokens``) uses the new run's rate
    and world size only. A new fit (``global_step`` 0, no state restored for it) starts its figures afresh.
    Idle dollars use GPUMonitor's mean utilisation when present, else StepTimer's input-wait share. Tokens and samples
    are counted like SpeedMonitor counts them (shapes, an attention mask's sum, or ``tokens_fn``/``samples_fn``);
    batches it cannot size leave out the per-token and per-sample figures (one warning) while dollars and hours are
    still reported.

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
        check_counting_args(_KEY, hardware, log_every_n_steps, samples_fn, tokens_fn)
        check_number(f"{_KEY}.price_per_device_hour", price_per_device_hour, low=0.0)
        self.hardware = hardware
        self.price_per_device_hour = price_per_device_hour
        self.target_tokens = check_whole(f"{_KEY}.target_tokens", target_tokens, minimum=1)
        self.log_every_n_steps = log_every_n_steps
        self.samples_fn = samples_fn
        self.tokens_fn = tokens_fn
        self._clock = clock or default_clock
        self._spec: HardwareSpec | None = None
        self._price: float | None = None
        # Figures of earlier runs (before a resume, or earlier spans of this fit): all devices, each run billed at the
        # world size it ran on. None: a batch was not sized, so the count is unknown for the run.
        self._hours_before = 0.0
        self._tokens_before: int | None = 0
        self._samples_before: int | None = 0
        # The current run: its wall time and the tokens and samples counted on this rank (never paused: validation
        # is billed too), its world size and first step.
        self._run = TrainingWindow(self._clock)
        self._devices = 1
        self._replicas = 1
        self._steps_start = 0
        self._sizer = BatchSizer(
            "CostMonitor", samples_fn, tokens_fn, "its per-token and per-sample figures are left out"
        )
        self._restore = FitRestore()
        self._logged_step = -1
        self._steps_done = 0
        self._steps_total: int | None = None
        self._edge = StepEdge()
        self._report: CostReport | None = None
        self._final_counts: tuple[int | None, int | None] = (None, None)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore.stage = stage
        if stage != "fit":
            return
        self._spec = resolve_hardware(self.hardware)
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
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore.stage = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips teardown when a stage raises; the time already trained stays billed.
        self._close_run()
        self._restore.end()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restore.new_run(trainer):  # figures start afresh
            self._hours_before, self._tokens_before, self._samples_before = 0.0, 0, 0
            self._sizer.warned = False
        dims = ParallelDims.from_trainer(trainer)
        self._devices, self._replicas = dims.world_size, dims.dp
        self._start_run(trainer.global_step)
        self._report = None
        self._edge.reset(trainer, self.log_every_n_steps)
        self._logged_step = -1
        self._steps_total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if self._steps_total is None:
            est = trainer.estimated_stepping_batches
            self._steps_total = int(est) if est != float("inf") else None

    def _start_run(self, step: int) -> None:
        self._run.reset()
        self._run.start()
        self._steps_start = self._steps_done = step

    def _close_run(self) -> None:
        """Fold the current run into the earlier runs' figures (at its own world size)."""
        if not self._run.started:
            return
        self._hours_before, self._tokens_before, self._samples_before = self._totals()
        self._run.reset()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        count = self._sizer(batch)
        self._run.add(count.samples, count.tokens)  # a device token count is read only at logging windows

    def _totals(self) -> tuple[float, int | None, int | None]:
        """Device-hours (all devices), tokens and samples (all replicas) so far: earlier runs plus the current one."""
        run = self._run.counts()
        return (
            self._hours_before + run.seconds / 3600 * self._devices,
            _plus(self._tokens_before, run.tokens, self._replicas),
            _plus(self._samples_before, run.samples, self._replicas),
        )

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
        """The cost so far (all devices, earlier runs included), projected at the current run's rate to
        ``target_tokens`` or the run's optimizer steps."""
        _, tokens, samples = self._totals()
        return cost_report(
            self._run.seconds(),
            self._devices,
            self._price,
            tokens,
            steps_done=self._steps_done,
            steps_total=self._steps_total,
            tokens_target=self.target_tokens,
            idle_fraction=self._idle_fraction(trainer),
            samples=samples,
            prior_device_hours=self._hours_before,
            prior_steps=min(self._steps_start, self._steps_done),
            prior_tokens=self._tokens_before or 0,
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
        if self._edge.crossed(trainer):
            self._steps_done = trainer.global_step
            if self._edge.closes_window(trainer):
                self._log(trainer, self.report(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps_done = trainer.global_step
        self._report = self.report(trainer)
        if self._logged_step != trainer.global_step:  # a run shorter than the window still logs its cost once
            self._log(trainer, self._report)
        self._close_run()
        self._final_counts = (self._tokens_before, self._samples_before)
        r = self._report
        if r.dollars is not None:
            rank_zero_info(
                f"CostMonitor: ${r.dollars:.4f} over {r.device_hours:.4f} device-hours"
                + (f", ${r.dollars_per_1b_tokens:.2f} per 1B tokens" if r.dollars_per_1b_tokens else "")
            )

    def summary(self) -> dict[str, Any]:
        """``{"cost": {device_hours, dollars, dollars_per_1b_tokens, dollars_per_1m_samples, projected_*,
        idle_fraction, dollars_lost_idle, tokens, samples, price_per_device_hour, price_source, hardware}}``.

        Figures of the last fit as it ended (earlier runs before a resume included); ``tokens``/``samples`` are all
        devices' and ``None`` when a batch could not be sized. Before any fit has ended: ``tokens``/``samples`` so far.
        """
        out: dict[str, Any] = self._report.to_dict() if self._report else {}
        tokens, samples = self._final_counts if self._report else self._totals()[1:]
        out["tokens"], out["samples"] = tokens, samples
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
        """``{"device_hours", "tokens", "samples"}`` so far, all devices (each run at its own world size)."""
        hours, tokens, samples = self._totals()
        return {"device_hours": hours, "tokens": tokens, "samples": samples}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the figures of earlier runs (all devices, each run billed at its own world size)."""
        running = self._run.started
        self._restore.loaded(running)
        tokens, samples = state_dict["tokens"], state_dict["samples"]
        self._hours_before = float(state_dict["device_hours"])
        self._tokens_before = None if tokens is None else int(tokens)
        self._samples_before = None if samples is None else int(samples)
        if running:  # loaded while training: time and counts from now on add to the restored figures
            self._start_run(self._steps_done)
