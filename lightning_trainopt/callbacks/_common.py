"""Helpers shared by the measuring callbacks (not public)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_trainopt.metrics.throughput import BatchSize, batch_size_of

if TYPE_CHECKING:
    from lightning_trainopt.metrics.hardware import HardwareSpec

Clock = Callable[[], float]


def default_clock() -> float:
    return time.perf_counter()


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every logger of the Trainer from global rank 0 (no collective, no sync), and put them into
    ``trainer.callback_metrics`` on every rank, as 0-d CPU tensors (as Lightning's ``LearningRateMonitor`` does), so
    that ``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and whoever reads the Trainer's metrics see the latest
    figures. CPU tensors: putting them there moves nothing to or from a device."""
    if not metrics:
        return
    trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step if step is None else step)


def check_log_every(key: str, value: int | None) -> None:
    """Refuse a logging window that is not ``None`` or a positive integer (``key`` names it in the error)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        from lightning_trainopt.exceptions import ConfigError

        raise ConfigError(key, value, "use a positive integer (optimizer steps), or null for the Trainer's.")


def default_warmup(warmup_steps: int | None, max_steps: int, start_step: int) -> int:
    """Timing warm-up steps: ``warmup_steps`` if given, else 1, or 0 where a single step is left to run.

    The first step pays allocation and compilation, so it is left out by default, but never the only step of a
    short run (``max_steps`` -1, no step limit, keeps 1).
    """
    if warmup_steps is not None:
        return warmup_steps
    return 0 if 0 < max_steps - start_step <= 1 else 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _not_a_string(value: Any) -> str:
    return " (a number, not a string)" if isinstance(value, str) else ""


def check_number(
    key: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float | None:
    """``value`` as a float if it is ``None`` or a number in ``[low, high]`` (``(low, high]`` with ``low_open``).

    Raises:
        ConfigError: anything else (a string such as ``"312"``, a bool, a number out of range), naming ``key``.
    """
    if value is None:
        return None
    ok = _is_number(value) and value == value  # NaN is out of every range
    ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
    if not ok:
        from lightning_trainopt.exceptions import ConfigError

        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low:g}")
        if high is not None:
            bounds.append(f"<= {high:g}")
        rng = f" {' and '.join(bounds)}" if bounds else ""
        raise ConfigError(key, value, f"use a number{rng}{_not_a_string(value)}.")
    return float(value)


def check_whole(key: str, value: Any, minimum: int = 1) -> int | None:
    """``value`` as an int if it is ``None`` or a whole number ``>= minimum``; whole floats count (Hydra reads ``1e9``
    as a float).

    Raises:
        ConfigError: a fraction, a string, a bool or a number below ``minimum``, naming ``key``.
    """
    if value is None:
        return None
    whole = _is_number(value) and (isinstance(value, int) or float(value).is_integer())
    if not whole or value < minimum:
        from lightning_trainopt.exceptions import ConfigError

        raise ConfigError(key, value, f"use a whole number >= {minimum}, e.g. 1e9 or 1000000000{_not_a_string(value)}.")
    return int(value)


def check_callable(key: str, value: Any) -> None:
    """Refuse a ``*_fn`` argument that is neither ``None`` nor callable."""
    if value is not None and not callable(value):
        from lightning_trainopt.exceptions import ConfigError

        raise ConfigError(key, value, "use a function of the batch (or null for the default).")


def check_hardware(key: str, value: Any) -> None:
    """Refuse a ``hardware`` argument that is not ``None``, ``auto``, a preset name or a ``HardwareSpec``.

    Preset names are resolved now (no device is queried), so a typo fails before training, not at ``setup``.
    """
    from lightning_trainopt.exceptions import ConfigError
    from lightning_trainopt.metrics.hardware import HardwareSpec, hardware_spec

    if value is None or value == "auto" or isinstance(value, HardwareSpec):
        return
    if not isinstance(value, str):
        raise ConfigError(key, value, "use a preset name (conf/hardware), auto, or a HardwareSpec (hardware_spec()).")
    try:
        hardware_spec(value)
    except ConfigError as err:
        raise ConfigError(key, value, err.fix) from err


def check_counting_args(key: str, hardware: Any, log_every_n_steps: Any, samples_fn: Any, tokens_fn: Any) -> None:
    """Refuse a bad argument of those the counting monitors (SpeedMonitor, CostMonitor) share; ``key`` is the
    callback's config key (``callbacks.speed_monitor``)."""
    check_hardware(f"{key}.hardware", hardware)
    check_log_every(f"{key}.log_every_n_steps", log_every_n_steps)
    check_callable(f"{key}.samples_fn", samples_fn)
    check_callable(f"{key}.tokens_fn", tokens_fn)


def resolve_hardware(value: Any) -> HardwareSpec:
    """The :class:`~lightning_trainopt.metrics.hardware.HardwareSpec` of a ``hardware`` argument (a spec, a preset
    name, or ``None``/``auto`` for the current device); resolved at ``setup``, once per fit."""
    from lightning_trainopt.metrics.hardware import HardwareSpec, hardware_spec

    return value if isinstance(value, HardwareSpec) else hardware_spec(value or "auto")


@dataclass(frozen=True)
class BatchCount:
    """What a monitor counted in one micro-batch: ``samples``/``tokens`` (``None``: unknown), and ``shape``, the
    batch's tensor shape (``None``: no tensor to read) for FLOPs."""

    samples: int | None
    tokens: int | torch.Tensor | None
    shape: BatchSize | None


class BatchSizer:
    """Samples and tokens of each micro-batch: the user's ``samples_fn``/``tokens_fn`` where given, else the shapes
    (:func:`~lightning_trainopt.metrics.throughput.batch_size_of`). A batch it cannot size gives ``None`` counts and one
    warning for the whole run, naming the arguments that fix it; it never raises for the batch's type.

    Args:
        owner: the callback's name, for the warning.
        samples_fn: ``batch -> int`` or ``None``.
        tokens_fn: ``batch -> int | Tensor`` or ``None``.
        consequence: what the owner leaves out when a count is unknown (for the warning).
    """

    def __init__(
        self,
        owner: str,
        samples_fn: Callable[[Any], Any] | None,
        tokens_fn: Callable[[Any], Any] | None,
        consequence: str,
    ) -> None:
        self.owner = owner
        self.samples_fn = samples_fn
        self.tokens_fn = tokens_fn
        self.consequence = consequence
        self.warned = False

    def __call__(self, batch: Any) -> BatchCount:
        try:
            shape: BatchSize | None = batch_size_of(batch, mask_tokens=self.tokens_fn is None)
        except TypeError:  # no tensor in the batch: the user functions may still size it
            shape = None
        samples = int(self.samples_fn(batch)) if self.samples_fn else (shape.samples if shape else None)
        tokens = self.tokens_fn(batch) if self.tokens_fn else (shape.tokens if shape else None)
        if (samples is None or tokens is None) and not self.warned:
            self.warned = True
            missing = [n for n, v in (("samples_fn", samples), ("tokens_fn", tokens)) if v is None]
            rank_zero_warn(
                f"{self.owner}: cannot size a batch of type {type(batch).__name__} (no tensor of shape (B, T, ...) "
                f"in it); {self.consequence}. "
                f"Pass {' and '.join(f'{n}=batch -> int' for n in missing)} to {self.owner} to count it.",
                category=UserWarning,
            )
        return BatchCount(samples, tokens if tokens is None or isinstance(tokens, torch.Tensor) else int(tokens), shape)


def log_interval(trainer: pl.Trainer, own: int | None) -> int:
    """The callback's logging window in optimizer steps: its own, else the Trainer's ``log_every_n_steps``."""
    return max(1, own if own is not None else int(getattr(trainer, "log_every_n_steps", 50) or 50))


def on_cuda(pl_module: pl.LightningModule) -> bool:
    return pl_module.device.type == "cuda"


def find_callback(trainer: pl.Trainer, cls_name: str) -> Any | None:
    """The first callback of the Trainer whose class is named ``cls_name`` (avoids import cycles)."""
    for cb in getattr(trainer, "callbacks", []):
        if type(cb).__name__ == cls_name:
            return cb
    return None


def warn_off(name: str, why: str) -> None:
    """The one line a monitor prints when it switches itself off."""
    rank_zero_warn(f"{name} is off: {why}", category=UserWarning)


def json_safe(value: Any) -> Any:
    """Floats, ints, strings, None, lists and dicts of them (tensors become numbers)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):  # NaN and +-Infinity are not JSON
        return None
    return value


class StepEdge:
    """Tells ``on_train_batch_end`` whether an optimizer step finished since the last call, and whether that step
    closes the monitor's logging window.

    Under gradient accumulation several batches end with the same ``trainer.global_step``; the monitors log and
    close their windows once per optimizer step, on the batch that moved it. The window length is resolved once per
    fit (:meth:`reset`), not at every step.
    """

    def __init__(self) -> None:
        self.last = -1
        self.every: int | None = None

    def reset(self, trainer: pl.Trainer, every: int | None = None) -> None:
        """Start counting from the Trainer's current step (fit start, resume) and fix this fit's logging window:
        ``every`` optimizer steps, or the Trainer's ``log_every_n_steps`` for ``None``."""
        self.last = trainer.global_step
        self.every = log_interval(trainer, every)

    def crossed(self, trainer: pl.Trainer) -> bool:
        """True once per new ``global_step``."""
        if trainer.global_step == self.last:
            return False
        self.last = trainer.global_step
        return True

    def closes_window(self, trainer: pl.Trainer) -> bool:
        """The Trainer's current step ends a logging window."""
        return trainer.global_step % (self.every or log_interval(trainer, None)) == 0

    def window_closed(self, trainer: pl.Trainer) -> bool:
        """:meth:`crossed` and the new step ends a logging window."""
        return self.crossed(trainer) and self.closes_window(trainer)


class FitRestore:
    """Whether the fit about to start continues a state restored into the monitor, or is a new run.

    Lightning restores callback state after ``setup("fit")`` (``ckpt_path``), or the user calls ``load_state_dict``
    before ``fit``; a restore during validate/test/predict starts no fit, and a restore counts for its own fit only
    (a fit that raises forgets it). A fit at ``global_step`` 0 with nothing restored for it is a new run, whose
    figures start afresh, also with a monitor object used before.
    """

    def __init__(self) -> None:
        self.stage: str | None = None
        self.restored = False

    def end(self) -> None:
        """The stage ended (``teardown``) or raised (``on_exception``): no stage runs, nothing restored is pending."""
        self.stage = None
        self.restored = False

    def loaded(self, running: bool = False) -> None:
        """``load_state_dict`` was called; ``running``: during training, so it belongs to this fit, not the next."""
        self.restored = self.stage in (None, "fit") and not running

    def new_run(self, trainer: pl.Trainer) -> bool:
        """At ``on_train_start``: True when this fit is a new run; uses up the pending restore either way."""
        restored, self.restored = self.restored, False
        return not restored and trainer.global_step == 0
