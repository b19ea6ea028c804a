"""SpeedMonitor: tokens/s, samples/s, model TFLOP/s, MFU and HFU per device and in total."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_trainopt.callbacks._common import (
    BatchSizer,
    Clock,
    StepEdge,
    check_callable,
    check_counting_args,
    check_number,
    default_clock,
    default_warmup,
    json_safe,
    log_metrics,
    resolve_hardware,
)
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.flops import SeqFlops, fit_seq_flops, transformer_flops
from lightning_trainopt.metrics.fp8_flops import fp8_flops_share, fp8_linear_shapes
from lightning_trainopt.metrics.hardware import HardwareSpec, compute_dtype_key
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.metrics.throughput import BatchSize, ThroughputWindow, TrainingWindow, WindowCounts
from lightning_trainopt.parallel.dims import ParallelDims

__all__ = ["SpeedMonitor"]

_KEY = "callbacks.speed_monitor"
#: ``flops_source`` values in the summary.
ANALYTIC, USER_FN, COUNTER, UNKNOWN = (
    "analytic transformer formula",
    "flops_per_batch_fn",
    "torch.utils.flop_counter on a meta copy",
    "unknown",
)


def _with_teacher_flops(
    flops: tuple[int, int] | None, pl_module: pl.LightningModule, shape: BatchSize | None, user_fn: bool
) -> tuple[int, int] | None:
    """A distilling module's teacher forward (``teacher_forward_flops``) is work done: added to model and hardware
    FLOPs (a ``flops_per_batch_fn`` of the user's is taken as the whole count)."""
    teacher = getattr(pl_module, "teacher_forward_flops", None)
    if flops is None or user_fn or not callable(teacher) or shape is None or shape.seq_len is None:
        return flops
    extra = int(teacher(shape.samples, shape.seq_len))
    return flops[0] + extra, flops[1] + extra


def checkpointed_fraction(module: torch.nn.Module, n_blocks: int | None) -> float:
    """Share of transformer blocks whose forward is recomputed in backward.

    Counts modules wrapped by our ``ActivationCheckpointing`` (``transforms.checkpointing.is_checkpointed``) and
    torch's ``CheckpointWrapper``. Without ``n_blocks`` (not our model) any wrapper counts as 1.
    """
    from lightning_trainopt.transforms.checkpointing import is_checkpointed

    wrapped = sum(1 for m in module.modules() if type(m).__name__ == "CheckpointWrapper" or is_checkpointed(m))
    if not wrapped:
        return 0.0
    return min(1.0, wrapped / n_blocks) if n_blocks else 1.0


def _recompute_from_callbacks(trainer: pl.Trainer, n_blocks: int | None) -> float | None:
    """The recomputed share an ``ActivationCheckpointing`` callback of this Trainer measured, for a foreign module.

    Our own model (``n_blocks`` known) keeps the share of blocks, which the analytic formula expects; any other
    module takes the callback's share of forward matmul FLOPs, which counts shared blocks per call and weights of
    every kind (``Conv1D``, attention in-projections), unlike counting wrapped modules.
    """
    if n_blocks:
        return None
    from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing

    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, ActivationCheckpointing) and cb.plan is not None:
            return cb.recomputed_fraction
    return None


class SpeedMonitor(Callback):
    """Throughput with honest MFU/HFU, logged once per window without synchronising any step.

    FLOPs per micro-batch come from the analytic formula when the module carries a :class:`GPTConfig` (``config``),
    from a ``flops_per_batch_fn`` you give, or from ``torch.utils.flop_counter``: at the first batch one meta-device
    copy of the module's ``forward`` (+ backward) is counted at four sequence lengths and fitted to
    ``B * (c + a*T + b*T^2)`` (:func:`~lightning_trainopt.metrics.flops.fit_seq_flops`), so later lengths cost nothing.
    The copy carries no hooks and full-shape parameters (:func:`~lightning_trainopt.metrics.flops.meta_copy`), so a
    module that DeepSpeed ZeRO-3 or FSDP2 has sharded and hooked is counted without touching the engine. If counting
    fails (e.g. a forward that reads tensor values) FLOPs are unknown: MFU, HFU and TFLOP/s are left out with one
    warning, tokens/s and samples/s are still reported; it never stops the fit. MFU counts model FLOPs (3x forward);
    HFU adds the recomputed forward of checkpointed blocks: the share of blocks wrapped for our model, the recomputed
    FLOPs measured by the flop counter (however the module checkpoints, also by itself) for any other, and the
    ``ActivationCheckpointing`` callback's estimate with ``flops_per_batch_fn``. Windows close every
    ``log_every_n_steps`` optimizer steps, at ``max_steps`` and at the end of fit, so short runs are measured too.
    Validation inside a window (``val_check_interval``, epoch-end validation) pauses its clock, so the rates are
    training time only; the sanity check runs before the first window opens.

    Counts are one data-parallel replica's (:class:`~lightning_trainopt.parallel.dims.ParallelDims` from the
    Trainer's strategy): ``*_total`` rates are ``dp`` replicas', never ``world_size`` ranks' (the ranks of a
    tensor-parallel group read the same micro-batches), and per-device rates, TFLOP/s, MFU and HFU share a
    replica's work over its ``world_size / dp`` devices.

    MFU and HFU are against the dense peak of the run's compute dtype; a mixed or FP8 run (``bf16-mixed`` with FP8
    layers, Lightning's ``transformer-engine``) is measured against the **bf16** dense peak, FP8 layers included, so
    an FP8 run and a bf16 run compare on one scale (an FP8 run can pass 100% of bf16's peak). ``fp8_flops_share`` is
    the share of the step's model FLOPs in the FP8 linear layers found in the model (torchao's ``Float8Linear``,
    Transformer Engine's ``Linear``): ``6 x out x in`` per token each; logged as ``throughput/fp8_flops_share`` when
    there are any, and in the summary (0 without).

    Each ``fit`` is measured afresh, unless the Trainer restored this callback from a checkpoint for that fit
    (``ckpt_path``): then the fit continues the checkpointed run. The checkpoint holds the closed windows' totals,
    the window still open at save time (its seconds, micro-batches, samples, tokens, FLOPs and whether each was
    known) and the step the run started at, so a checkpoint + resume reports the same totals as an uninterrupted
    run. Warm-up is the first ``warmup_steps`` optimizer steps of the *run*, not of each process: a resume after
    the warm-up drops no further step, a resume inside it drops only the warm-up steps left (the resumed process's
    own start-up cost, e.g. re-compilation, is therefore counted in the first window after a resume).

    Args:
        log_every_n_steps: window in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        hardware: a :class:`HardwareSpec` or preset name (``conf/hardware``); default ``auto`` (the current device).
        peak_tflops: override the dense peak TFLOP/s per device for the precision in use (needed for MFU on CPU).
        samples_fn: ``batch -> int`` samples of a micro-batch (default: inferred from shapes).
        tokens_fn: ``batch -> int | Tensor`` tokens of a micro-batch (default: shapes, or an attention mask's sum).
        flops_per_batch_fn: ``batch -> int`` model FLOPs (forward + backward) of a micro-batch.
        recompute_fraction: share of the forward recomputed in backward, for HFU (default: detected or measured).
        warmup_steps: the run's first optimizer steps, left out of every window and of the end-of-fit figures
            (counted from the run's start, across resumes). Default (``None``): 1, or 0 in a run of a single step,
            so a 1-step run is measured too.
        clock: seconds since an arbitrary origin (tests inject a fake).

    Raises:
        ConfigError: an argument of the wrong type or range (e.g. ``peak_tflops="312"``), or an unknown preset name.

    Example::

        trainer = Trainer(callbacks=[SpeedMonitor(hardware="h100_sxm")])
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        hardware: HardwareSpec | str | None = None,
        peak_tflops: float | None = None,
        samples_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], Any] | None = None,
        flops_per_batch_fn: Callable[[Any], int] | None = None,
        recompute_fraction: float | None = None,
        warmup_steps: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        check_counting_args(_KEY, hardware, log_every_n_steps, samples_fn, tokens_fn)
        check_callable(f"{_KEY}.flops_per_batch_fn", flops_per_batch_fn)
        check_number(f"{_KEY}.peak_tflops", peak_tflops, low=0.0, low_open=True)
        check_number(f"{_KEY}.recompute_fraction", recompute_fraction, low=0.0, high=1.0)
        if warmup_steps is not None and (
            not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0
        ):
            raise ConfigError(f"{_KEY}.warmup_steps", warmup_steps, "use an integer >= 0, or null.")
        self.log_every_n_steps = log_every_n_steps
        self.hardware = hardware
        self.peak_tflops = peak_tflops
        self.samples_fn, self.tokens_fn, self.flops_per_batch_fn = samples_fn, tokens_fn, flops_per_batch_fn
        self.recompute_fraction = recompute_fraction
        self.warmup_steps = warmup_steps
        self._warmup = 1 if warmup_steps is None else warmup_steps
        self._clock = clock or default_clock
        self._edge = StepEdge()
        self._spec: HardwareSpec | None = None
        self._peak: float | None = None
        self._dtype = "fp32"
        self._peak_dtype = "fp32"
        self._fp8_shapes: tuple[tuple[int, int], ...] = ()
        self._fp8_share: float | None = None
        self._start_step = 0
        self._dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
        self._recompute = 0.0
        self._total = WindowCounts()  # the closed windows of this run (warm-up excluded)
        self._window = TrainingWindow(self._clock)  # the open window: time (paused by validation) and counts
        # Set by load_state_dict (Lightning restores callbacks after `setup`): this fit continues a checkpointed run.
        self._restored: dict[str, Any] | None = None
        self._new_fit()

    def _new_fit(self) -> None:
        self._sizer = BatchSizer(
            "SpeedMonitor", self.samples_fn, self.tokens_fn, "its samples/s or tokens/s are left out"
        )
        self._flops_source = "none"
        self._flops_note: str | None = None
        self._fit: SeqFlops | None = None
        # (model, hardware) FLOPs per (samples, seq_len): evaluating the fit's fractions costs ~0.1 ms.
        self._fit_cache: dict[tuple[int, int | None], tuple[int, int]] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restored = None  # only a restore that follows this `setup` belongs to this run
        if stage != "fit":
            return
        self._total = WindowCounts()  # a new fit is measured afresh; load_state_dict (after setup) may restore
        self._window.reset()
        self._spec = resolve_hardware(self.hardware)
        on_gpu = trainer.strategy.root_device.type == "cuda"
        self._dtype = compute_dtype_key(str(trainer.precision), on_gpu, torch.get_float32_matmul_precision())
        # FP8 runs are measured against the bf16 dense peak (Lightning's transformer-engine precision maps to fp8).
        self._peak_dtype = "bf16" if self._dtype == "fp8" else self._dtype
        self._peak = self.peak_tflops * 1e12 if self.peak_tflops else self._spec.peak(self._peak_dtype)
        if self._peak is None:
            rank_zero_info(
                f"SpeedMonitor: MFU/HFU omitted: no peak FLOP/s known for {self._spec.name} in {self._peak_dtype}; "
                f"pass SpeedMonitor(peak_tflops=...), or with train.py +hardware.peak_tflops.{self._peak_dtype}="
                "<TFLOP/s>."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cfg = getattr(pl_module, "config", None)
        n_blocks = cfg.n_layers if isinstance(cfg, GPTConfig) else None
        recompute = (
            self.recompute_fraction
            if self.recompute_fraction is not None
            else _recompute_from_callbacks(trainer, n_blocks)
        )
        self._recompute = checkpointed_fraction(pl_module, n_blocks) if recompute is None else recompute
        # The precision plugin converts the model before training starts: its FP8 layers are in place now.
        self._fp8_shapes = fp8_linear_shapes(pl_module)
        self._fp8_share = None
        self._edge.reset(trainer, self.log_every_n_steps)
        self._start_step = trainer.global_step
        self._dims = ParallelDims.from_trainer(trainer)
        self._new_fit()
        self._window.reset()
        restored, self._restored = self._restored, None
        if restored is not None:
            # Resumed: warm-up counts from the run's first step, and the window open at save time goes on.
            self._start_step = int(restored["start_step"])
            window = restored["window"]
            if window:
                self._window.restore(WindowCounts.from_dict(window))
        self._warmup = default_warmup(self.warmup_steps, trainer.max_steps, self._start_step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation (val_check_interval, epoch end) is not training: stop the window's clock. No window is open
        # during the sanity check (it runs before on_train_start).
        if self._window.paused or not self._window.started:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the window's queued training work belongs to it
        self._window.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._window.paused:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the validation's queued work is not the window's
        self._window.resume()

    def _with_recompute(self, model_flops: int) -> int:
        return int(round(model_flops * (1 + self._recompute / 3)))

    def _flops_unknown(self, reason: str) -> None:
        self._flops_source = UNKNOWN
        self._flops_note = reason
        self._total = replace(self._total, model_flops=None, hardware_flops=None)
        rank_zero_warn(
            f"SpeedMonitor: FLOPs unknown, so MFU, HFU and TFLOP/s are left out (tokens/s and samples/s are still "
            f"reported): {reason[:800]}. Pass SpeedMonitor(flops_per_batch_fn=batch -> training FLOPs of the "
            f"micro-batch) to give them.",
            category=UserWarning,
        )

    def _fit_flops(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, shape: BatchSize | None
    ) -> None:
        """Count the module's FLOPs once (first batch, before its window's clock starts)."""
        if shape is None:
            self._flops_unknown("the batch has no tensor to read its shape from")
            return
        try:
            self._fit = fit_seq_flops(pl_module, batch, shape.samples, shape.seq_len, share=(trainer,))
        except Exception as err:  # the user's forward on meta tensors may fail in any way; the fit must go on
            self._flops_unknown(f"{type(pl_module).__name__}'s forward could not be counted on a meta copy ({err})")
            return
        self._flops_source = COUNTER
        if self.recompute_fraction is not None:
            return
        if self._fit.recompute_share is not None:
            # Measured while counting: whatever checkpoints the module (our callback, checkpoint_wrapper, HF's
            # gradient_checkpointing_enable(), its own checkpoint calls), its recomputed forward was counted.
            self._recompute = float(self._fit.recompute_share)
        else:
            # This torch counts recomputation without telling it apart: it is already inside the counted FLOPs.
            self._recompute = 0.0
            self._flops_note = "this torch cannot tell recomputed FLOPs apart: MFU counts them, HFU equals MFU"

    def _batch_flops(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, shape: BatchSize | None
    ) -> tuple[int, int] | None:
        """(model FLOPs, hardware FLOPs) of one micro-batch; ``None`` when unknown."""
        if self.flops_per_batch_fn is not None:
            self._flops_source = USER_FN
            f = int(self.flops_per_batch_fn(batch))
            return f, self._with_recompute(f)
        cfg = getattr(pl_module, "config", None)
        if isinstance(cfg, GPTConfig) and shape is not None and shape.seq_len is not None:
            self._flops_source = ANALYTIC
            tf = transformer_flops(cfg, shape.seq_len, shape.samples)
            return tf.train, tf.hardware_train(self._recompute)
        if self._flops_source == UNKNOWN:
            return None
        if self._fit is None:
            self._fit_flops(trainer, pl_module, batch, shape)
            if self._fit is None:
                return None
        if shape is None or not self._fit.applies_to(shape.seq_len):
            self._flops_unknown(
                f"a batch of another structure (sequence length {shape.seq_len if shape else None}) than the "
                f"one counted ({self._fit.call} at T={self._fit.lengths[0] if self._fit.lengths else None})"
            )
            return None
        key = (shape.samples, shape.seq_len)
        if key not in self._fit_cache:
            model = self._fit(*key)
            given = self.recompute_fraction is not None
            self._fit_cache[key] = (model, self._with_recompute(model) if given else self._fit.hardware(*key))
        return self._fit_cache[key]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        count = self._sizer(batch)
        flops = self._batch_flops(trainer, pl_module, batch, count.shape)  # before the clock: counting is not timed
        flops = _with_teacher_flops(flops, pl_module, count.shape, self._flops_source == USER_FN)
        self._window.start()
        model, hardware = flops if flops is not None else (None, None)
        if model and count.shape is not None and count.shape.seq_len is not None:
            # Over the positions the model computes (samples x length), as its FLOPs are counted.
            self._fp8_share = fp8_flops_share(self._fp8_shapes, count.shape.samples * count.shape.seq_len, model)
        self._window.add(count.samples, count.tokens, model, hardware)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._edge.crossed(trainer):
            return
        step = trainer.global_step
        if step - self._start_step <= self._warmup:
            self._window.reset()
            self._window.start()
            return
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= step
        if last or self._edge.closes_window(trainer):
            self._close_window(trainer, pl_module)

    def _close_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._window
        if not window.batches or (not window.started and not window.seconds()):
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # once per window: the window's GPU work is done
        counts = window.close()  # the next window's clock starts now
        if counts.seconds <= 0:
            window.reset()
            return
        self._total += counts
        rates = self._rates(counts)
        metrics = {f"throughput/{k}": v for k, v in rates.to_dict().items() if v is not None and k != "seconds"}
        if self._fp8_shapes and self._fp8_share is not None:
            metrics["throughput/fp8_flops_share"] = self._fp8_share
        log_metrics(trainer, metrics)

    def _rates(self, counts: WindowCounts) -> ThroughputWindow:
        # The counts are this rank's, one data-parallel replica's: totals count replicas, not ranks (a
        # tensor-parallel group's ranks read the same micro-batches).
        return counts.rates(self._dims.world_size, self._peak, self._dims.dp)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dims = ParallelDims.from_trainer(trainer)
        # The last window may be partial (fewer steps than log_every_n_steps, an epoch-based end): close it so that
        # short runs are measured too.
        self._close_window(trainer, pl_module)
        self._window.reset()

    def summary(self) -> dict[str, Any]:
        """``{"throughput": {...}}``: means over this fit's closed windows (warm-up excluded) for metrics.json.

        A fit resumed from a checkpoint adds to the checkpointed run's windows: the figures are the whole run's.

        Keys: the rates of :class:`~lightning_trainopt.metrics.throughput.ThroughputWindow`, ``seconds``, ``samples``,
        ``tokens``, ``flops_per_token``, ``dtype``, ``peak_tflops``, ``peak_source``, ``hardware``,
        ``flops_source`` (analytic formula, flops_per_batch_fn, flop counter or unknown), ``flops_fit`` (the fitted
        ``c, a, b``, lengths and call, flop counter only), ``flops_note`` (why FLOPs are unknown),
        ``recompute_fraction``, ``peak_dtype`` (the dtype whose dense peak MFU/HFU are against: bf16 for mixed and FP8
        runs), ``mfu_note`` (how to read MFU when FP8 layers ran), ``fp8_layers`` and ``fp8_flops_share`` (the
        share of the model FLOPs in FP8 layers; 0 without any, ``None`` when FLOPs are unknown).
        """
        t = self._total
        known = bool(t.model_flops)
        out: dict[str, Any] = {
            "dtype": self._dtype,
            "peak_tflops": self._peak / 1e12 if self._peak else None,
            "peak_source": (self._spec.sources.get("peak") if self._spec else None)
            if not self.peak_tflops
            else "user-set (peak_tflops)",
            "hardware": self._spec.name if self._spec else None,
            "flops_source": self._flops_source,
            "flops_fit": self._fit.to_dict() if self._fit is not None else None,
            "flops_note": self._flops_note,
            "recompute_fraction": self._recompute,
            "peak_dtype": self._peak_dtype,
            "fp8_layers": len(self._fp8_shapes),
            "fp8_flops_share": (self._fp8_share if self._fp8_shapes else 0.0) if known else None,
            "mfu_note": (
                f"MFU and HFU are against the dense {self._peak_dtype} peak; the FP8 layers' FLOPs count at it too"
                if self._fp8_shapes or self._dtype == "fp8"
                else None
            ),
            "seconds": t.seconds,
            "samples": t.samples,
            "tokens": t.tokens,
        }
        if t.seconds > 0:
            counted = t if known else replace(t, model_flops=None, hardware_flops=None)
            out.update(self._rates(counted).to_dict())
            out["flops_per_token"] = t.model_flops / t.tokens if t.model_flops and t.tokens else None
        return {"throughput": json_safe(out)}

    @override
    def state_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)`` reads it): totals, the open window and the run's first step.

        Keys: ``totals`` (the closed windows) and ``window`` (the open one, its ``seconds`` of training so far), each
        :meth:`~lightning_trainopt.metrics.throughput.WindowCounts.to_dict` (``seconds``, ``batches``, ``samples``,
        ``tokens``, ``model_flops``, ``hardware_flops``, ``flops_known``; ``None``: unknown), and ``start_step`` (the
        global step the run started at, for warm-up).
        """
        if self._restored is not None:  # loaded and not applied yet (no fit since): saved as it was loaded
            return {"totals": self._total.to_dict(), **self._restored}
        # The open window's device token counter is read back here, once, at checkpoint time.
        window = self._window.counts().to_dict()
        return {"totals": self._total.to_dict(), "window": window, "start_step": int(self._start_step)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._total = WindowCounts.from_dict(state_dict["totals"])
        # Applied in on_train_start.
        self._restored = {"window": state_dict["window"], "start_step": state_dict["start_step"]}
