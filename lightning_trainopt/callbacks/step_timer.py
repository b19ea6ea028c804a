"""StepTimer: where each optimizer step's time goes, and a verdict with remedies at the end of fit."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import fetch_hooks, restore_fetch_hooks, set_fetch_hooks
from lightning_trainopt._compat.torch_internals import is_compiled
from lightning_trainopt.callbacks._comm_probe import CommProbe, attach_comm_probe
from lightning_trainopt.callbacks._common import (
    Clock,
    FitRestore,
    check_log_every,
    default_clock,
    default_warmup,
    json_safe,
    log_interval,
    log_metrics,
)
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.step_time import StepSplit, Verdict, split_marks, step_verdict

__all__ = ["StepTimer"]


class StepTimer(Callback):
    """Splits every optimizer step into data wait, host-to-device copy, forward, backward, exposed comm and optimizer.

    Timestamps are taken at hook boundaries: host ``perf_counter`` on CPU, CUDA events on GPU (recorded
    asynchronously, read once per logging window), so the training loop is never synchronised per step.

    ``data_wait`` is the time the training loop spends in ``next()`` on its data fetcher, timed through the loop's
    fetch hooks (the ones Lightning's profilers use for ``train_dataloader_next``). The rest of the gap between two
    steps (checkpoint saving, other callbacks, logging) is ``other``, so a slow checkpoint is never called input-bound.
    If a Lightning version lacks those hooks, one line says so and the whole gap counts as ``data_wait``
    (``fetch_timed: false``).

    Exposed communication (``comm``) is the time from the hand-over of the last gradient to the reduction until
    backward returns with reduced gradients; it is taken out of ``backward``. Where it is measured:

    - DDP: StepTimer registers a communication hook (the default all-reduce plus one mark on the last bucket) at
      fit start. If DDP already has a hook (``DDPStrategy(ddp_comm_hook=...)``), it is left alone, ``comm`` is not
      measured and one line says so. ``no_sync`` micro-batches of gradient accumulation reduce nothing and count
      as backward.
    - DeepSpeed, FSDP2, tensor parallel (ModelParallelStrategy) and others: not measured (``comm_measured: false``,
      one line says so); the wait stays inside forward, backward or the optimizer step, and the verdict never says
      communication-bound. (DeepSpeed's backward epilogue mixes the reduction wait with its gradient bookkeeping.)

    ``comm`` includes waiting for slower ranks (an all-reduce ends when every rank has joined it). Reductions that
    overlap backward are not exposed and count as backward, although on CPU (gloo) they compete with it for cores.

    A new fit (``global_step`` 0, no state restored for it) starts its split afresh, also with a callback object used
    before; a fit resumed from a checkpoint (``load_state_dict``) adds to the checkpoint's split.

    Args:
        log_every_n_steps: logging window in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        warmup_steps: optimizer steps left out of the end-of-fit split (first-step allocation, compilation).
            Default (``None``): 1, or 0 when the fit has a single step to go, so a 1-step run is timed too.
        input_threshold: share of wall time in data wait + copy above which the verdict is ``input-bound``.
        optimizer_threshold: share in the optimizer step above which it is ``optimizer/offload-bound``.
        comm_threshold: share of measured exposed communication above which it is ``communication-bound``.
        other_threshold: share of ``other`` (checkpointing, callbacks, logging between steps) above which it is
            ``overhead-bound``.
        clock: seconds since an arbitrary origin (tests inject a fake; default ``time.perf_counter``).

    Example::

        trainer = Trainer(callbacks=[StepTimer()])
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        warmup_steps: int | None = None,
        input_threshold: float = 0.15,
        optimizer_threshold: float = 0.30,
        comm_threshold: float = 0.25,
        other_threshold: float = 0.30,
        clock: Clock | None = None,
    ) -> None:
        check_log_every("callbacks.step_timer.log_every_n_steps", log_every_n_steps)
        if warmup_steps is not None and (
            not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0
        ):
            raise ConfigError("callbacks.step_timer.warmup_steps", warmup_steps, "use an integer >= 0, or null.")
        for key, value in (
            ("input_threshold", input_threshold),
            ("optimizer_threshold", optimizer_threshold),
            ("comm_threshold", comm_threshold),
            ("other_threshold", other_threshold),
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value < 1.0:
                raise ConfigError(f"callbacks.step_timer.{key}", value, "use a fraction between 0 and 1.")
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self._warmup = 1 if warmup_steps is None else warmup_steps
        self.input_threshold = input_threshold
        self.optimizer_threshold = optimizer_threshold
        self.comm_threshold = comm_threshold
        self.other_threshold = other_threshold
        self._clock = clock or default_clock
        self._cuda = False
        self._marks: list[tuple[str, Any]] = []
        self._total = StepSplit()
        self._last_step = -1
        self._every = 1
        self._verdict: Verdict | None = None
        self._loader: dict[str, Any] = {}
        self._precision: str | None = None
        self._compiled: bool | None = None
        self._patched: tuple[Any, Any] | None = None
        self._fetch_patched: Any = None
        self._fetch_timed = False
        self._probe: CommProbe | None = None
        self._probe_kind: str | None = None
        self._comm_note: str | None = None
        self._restore = FitRestore()

    def _mark(self, name: str) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, self._clock()))

    def _resolve(self) -> list[tuple[str, float]]:
        if not self._marks:
            return []
        if not self._cuda:
            return [(n, float(t)) for n, t in self._marks]
        last = self._marks[-1][1]
        last.synchronize()  # once per logging window
        first = self._marks[0][1]
        return [(n, first.elapsed_time(e) / 1000.0) for n, e in self._marks]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore.stage = stage
        if stage != "fit" or self._patched is not None:
            return
        strategy = trainer.strategy
        original = strategy.batch_to_device

        def timed_batch_to_device(*args: Any, **kwargs: Any) -> Any:
            training = trainer.training
            if training:
                self._mark("h2d_start")
            out = original(*args, **kwargs)
            if training:
                self._mark("h2d_end")
            return out

        # An instance attribute shadows the method for the loop's `_call_strategy_hook`; teardown removes it.
        strategy.batch_to_device = timed_batch_to_device  # type: ignore[method-assign]
        self._patched = (strategy, original)
        self._patch_fetch(trainer)

    def _patch_fetch(self, trainer: pl.Trainer) -> None:
        # The training epoch loop hands its `_on_before_fetch`/`_on_after_fetch` methods to the data fetcher at every
        # epoch start (`_TrainingEpochLoop.on_run_start`); the fetcher calls them right around `next(iterator)`.
        # Instance attributes shadow the methods for that lookup; teardown removes them. Private API: guarded.
        hooks = fetch_hooks(trainer)
        if hooks is None:
            self._fetch_timed = False
            rank_zero_info(
                "StepTimer: this Lightning version has no fetch hooks on the training loop, so the dataloader fetch is "
                "not timed; data_wait is the whole gap between steps (it then includes checkpointing and callbacks)."
            )
            return
        loop, before, after = hooks

        def timed_before() -> None:
            before()
            if trainer.training:
                self._mark("fetch_start")

        def timed_after() -> None:
            if trainer.training:
                self._mark("fetch_end")
            after()

        set_fetch_hooks(loop, timed_before, timed_after)
        self._fetch_patched = loop
        self._fetch_timed = True

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The strategy has wrapped the model by now, and no backward has run: DDP hooks must be registered before.
        if self._probe is not None:
            self._probe.detach()
        self._probe, why = attach_comm_probe(trainer.strategy.model, trainer.world_size, self._grads_ready)
        if why is not None and why != self._comm_note:
            rank_zero_info(f"StepTimer: exposed communication not measured: {why}.")
        self._comm_note = why
        self._probe_kind = self._probe.kind if self._probe is not None else None

    def _grads_ready(self) -> None:
        self._mark("grads_ready")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning does not call Callback.teardown when fit raises (trainer/call.py), so clean up here too.
        self.teardown(trainer, pl_module, "fit")
        self._restore.end()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore.stage = None
        if self._probe is not None:
            self._probe.detach()
            self._probe = None
        if self._patched is not None:
            strategy, _ = self._patched
            if "batch_to_device" in vars(strategy):
                del strategy.batch_to_device
            self._patched = None
        if self._fetch_patched is not None:
            restore_fetch_hooks(self._fetch_patched)
            self._fetch_patched = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restore.new_run(trainer):  # its split starts afresh
            self._total = StepSplit()
            self._verdict = None
        self._cuda = pl_module.device.type == "cuda"
        self._marks = []
        self._last_step = trainer.global_step
        self._start_step = trainer.global_step
        self._every = log_interval(trainer, self.log_every_n_steps)  # once per fit, not at every step
        self._warmup = default_warmup(self.warmup_steps, trainer.max_steps, self._start_step)
        loader = trainer.train_dataloader
        self._loader = {
            "num_workers": getattr(loader, "num_workers", None),
            "pin_memory": getattr(loader, "pin_memory", None),
            "prefetch_factor": getattr(loader, "prefetch_factor", None),
        }
        offload = getattr(trainer.strategy, "config", None)
        zero = offload.get("zero_optimization", {}) if isinstance(offload, dict) else {}
        self._offload = bool(zero.get("offload_optimizer") or zero.get("offload_param"))
        # What the run already does, so that the compute-bound verdict does not advise it.
        self._precision = str(trainer.precision)
        self._compiled = is_compiled(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._mark("batch_start")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training or self._marks:
            self._mark("pause")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._marks:
            self._mark("resume")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._mark("before_backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark("after_backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._mark("before_optimizer_step")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._mark("batch_end")
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        if step - self._start_step <= self._warmup:
            # Drop warm-up steps; the window restarts at this step's end.
            self._marks = self._marks[-1:]
            return
        if step % self._every == 0:
            self._close_window(trainer)

    def _close_window(self, trainer: pl.Trainer) -> None:
        times = self._resolve()
        split = split_marks(times, comm_measured=self._probe is not None, fetch_timed=self._fetch_timed)
        self._marks = self._marks[-1:]
        if split.steps == 0 or split.wall <= 0:
            return
        self._total.merge(split)
        fractions = split.fractions()
        metrics = {f"step_time/{k}_frac": v for k, v in fractions.items()}
        metrics["step_time/step_s"] = split.wall / split.steps
        log_metrics(trainer, metrics)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Close the partial last window so short runs still get a split.
        if len(self._marks) > 1:
            self._close_window(trainer)
        self._marks = []
        self._verdict = step_verdict(
            self._total,
            num_workers=self._loader.get("num_workers"),
            pin_memory=self._loader.get("pin_memory"),
            prefetch_factor=self._loader.get("prefetch_factor"),
            cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            offload=self._offload,
            precision=self._precision,
            compiled=self._compiled,
            input_threshold=self.input_threshold,
            optimizer_threshold=self.optimizer_threshold,
            comm_threshold=self.comm_threshold,
            other_threshold=self.other_threshold,
        )
        v = self._verdict
        fixes = "; ".join(v.remedies)
        rank_zero_info(f"StepTimer: {v.kind} ({v.reason}).{' Remedies: ' + fixes if fixes else ''}")

    @property
    def split(self) -> StepSplit:
        """The split of this run, warm-up excluded: a resumed fit adds to the checkpoint's split (``load_state_dict``),
        a new one (``global_step`` 0, nothing restored) starts afresh."""
        return self._total

    def summary(self) -> dict[str, Any]:
        """``{"step_time": {<phase>_frac, step_s, steps, fetch_timed, comm_measured, comm_probe, verdict, ...}}``.

        ``other_frac`` is the time in no phase (checkpointing, callbacks, logging between steps); ``fetch_timed`` says
        ``data_wait`` is the timed fetch (false: the whole gap between steps, an upper bound).
        ``comm_frac`` is among the fractions only when ``comm_measured``; ``comm_probe`` names the probe of the last
        fit (``ddp_comm_hook`` or None) and ``comm_note`` why there was none (None on a single device);
        ``verdict``, ``reason`` and ``remedies`` come from :func:`~lightning_trainopt.metrics.step_time.step_verdict`.
        """
        total = self._total
        out: dict[str, Any] = {f"{k}_frac": v for k, v in total.fractions().items()}
        out["step_s"] = total.wall / total.steps if total.steps else None
        out["steps"] = total.steps
        out["fetch_timed"] = self._fetch_timed
        out["comm_measured"] = total.comm_measured
        out["comm_probe"] = self._probe_kind
        out["comm_note"] = self._comm_note
        if self._verdict is not None:
            out.update(verdict=self._verdict.kind, reason=self._verdict.reason, remedies=list(self._verdict.remedies))
        return {"step_time": json_safe(out)}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"total": self._total.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restore.loaded()
        t = state_dict["total"]
        self._total = StepSplit(
            seconds=dict(t["seconds"]), wall=t["wall"], steps=t["steps"], comm_measured=t["comm_measured"]
        )
