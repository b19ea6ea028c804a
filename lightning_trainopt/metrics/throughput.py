"""Throughput arithmetic: samples and tokens of a batch, rates, MFU and HFU over a window of steps, and the window
accumulator that the measuring callbacks share (:class:`TrainingWindow`; Lightning's ``Throughput`` plays this part
for its ``ThroughputMonitor``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

__all__ = ["BatchSize", "ThroughputWindow", "TrainingWindow", "WindowCounts", "batch_size_of", "throughput"]


@dataclass(frozen=True)
class BatchSize:
    """Samples and tokens of one micro-batch.

    ``tokens`` is a host int when it follows from shapes, or a 0-d device tensor when it needs an attention mask's
    sum (read only at logging windows, so that counting never synchronises a step).
    """

    samples: int
    tokens: int | torch.Tensor
    seq_len: int | None


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        for key in ("input_ids", "inputs", "x", "tokens"):
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
        for value in batch.values():
            found = _first_tensor(value)
            if found is not None:
                return found
        return None
    if isinstance(batch, (tuple, list)):
        for value in batch:
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def batch_size_of(batch: Any, mask_tokens: bool = True) -> BatchSize:
    """Infer samples and tokens from common batch shapes.

    A tensor ``(B, T, ...)``, a tuple/list whose first tensor is ``(B, T)``, or a dict with ``input_ids`` (and an
    optional ``attention_mask``, whose sum counts the real tokens of padded, variable-length batches). A 1-D tensor
    counts ``B`` samples of one token.

    Args:
        batch: one micro-batch.
        mask_tokens: sum an ``attention_mask`` for the tokens; ``False`` counts ``B * T`` (when tokens come from
            elsewhere, this launches no device work).

    Raises:
        TypeError: no tensor in the batch; pass ``samples_fn=`` / ``tokens_fn=`` to the callback instead.
    """
    x = _first_tensor(batch)
    if x is None:
        raise TypeError(
            f"cannot infer the batch size of a {type(batch).__name__}: pass samples_fn= and tokens_fn= to the callback"
        )
    samples = int(x.shape[0]) if x.dim() else 1
    seq_len = int(x.shape[1]) if x.dim() >= 2 else None
    tokens: int | torch.Tensor = samples * (seq_len or 1)
    if mask_tokens and isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        tokens = batch["attention_mask"].detach().sum()
    return BatchSize(samples, tokens, seq_len)


@dataclass(frozen=True)
class ThroughputWindow:
    """Rates over a window of micro-batches per device, and of the whole job (``*_total``: all data-parallel replicas).

    A rate is ``None`` when its count is unknown (a batch the callback could not size, FLOPs it could not count).
    """

    seconds: float
    samples_per_s: float | None
    tokens_per_s: float | None
    samples_per_s_total: float | None
    tokens_per_s_total: float | None
    tflops_per_s: float | None
    mfu: float | None
    hfu: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def throughput(
    seconds: float,
    samples: int | None,
    tokens: int | None,
    world_size: int = 1,
    model_flops: int | None = None,
    hardware_flops: int | None = None,
    peak_flops: float | None = None,
    data_parallel_size: int | None = None,
) -> ThroughputWindow:
    """Rates over ``seconds`` in which one data-parallel rank processed ``samples``/``tokens`` and ``*_flops``.

    The counts are one replica's (its micro-batches, whose model FLOPs the ``world_size / data_parallel_size``
    devices of the replica share: tensor parallelism). Totals are ``data_parallel_size`` replicas'; per-device rates
    (``samples_per_s``, ``tokens_per_s``, TFLOP/s, MFU, HFU) are the totals over ``world_size`` devices, which is one
    rank's counts when every rank is a replica (``data_parallel_size`` ``None``: the world size). Totals assume every
    replica runs the same number of micro-batches in the window. MFU = model FLOP/s per device / peak; HFU counts
    recomputation too. Both are ``None`` without a peak. Unknown counts (``None``) give ``None`` rates.

    Raises:
        ValueError: ``seconds`` is not positive, or ``data_parallel_size`` does not divide ``world_size``.
    """
    if not seconds > 0:
        raise ValueError(f"a throughput window needs a positive duration, got {seconds}")
    dp = world_size if data_parallel_size is None else data_parallel_size
    if dp < 1 or world_size % dp:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be a positive divisor of {world_size=}")
    share = world_size // dp  # devices per replica: each holds 1/share of the replica's work

    def per_device(count: int | None) -> float | None:
        return None if count is None else count / share / seconds

    hfu_flops = hardware_flops if hardware_flops is not None else model_flops
    model_rate, hardware_rate = per_device(model_flops), per_device(hfu_flops)
    return ThroughputWindow(
        seconds=seconds,
        samples_per_s=per_device(samples),
        tokens_per_s=per_device(tokens),
        samples_per_s_total=None if samples is None else samples * dp / seconds,
        tokens_per_s_total=None if tokens is None else tokens * dp / seconds,
        tflops_per_s=None if model_rate is None else model_rate / 1e12,
        mfu=None if model_rate is None or not peak_flops else model_rate / peak_flops,
        hfu=None if hardware_rate is None or not peak_flops else hardware_rate / peak_flops,
    )


def _plus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


@dataclass(frozen=True)
class WindowCounts:
    """What one device processed in a span of training: seconds, micro-batches, samples, tokens and FLOPs.

    A count is ``None`` when it is unknown (a micro-batch that could not be sized, FLOPs that could not be counted);
    a sum with an unknown count is unknown.
    """

    seconds: float = 0.0
    batches: int = 0
    samples: int | None = 0
    tokens: int | None = 0
    model_flops: int | None = 0
    hardware_flops: int | None = 0

    def __add__(self, other: WindowCounts) -> WindowCounts:
        return WindowCounts(
            self.seconds + other.seconds,
            self.batches + other.batches,
            _plus(self.samples, other.samples),
            _plus(self.tokens, other.tokens),
            _plus(self.model_flops, other.model_flops),
            _plus(self.hardware_flops, other.hardware_flops),
        )

    def rates(
        self, world_size: int = 1, peak_flops: float | None = None, data_parallel_size: int | None = None
    ) -> ThroughputWindow:
        """:func:`throughput` of these counts (``seconds`` must be positive; they are one data-parallel rank's)."""
        return throughput(
            self.seconds,
            self.samples,
            self.tokens,
            world_size,
            self.model_flops,
            self.hardware_flops,
            peak_flops,
            data_parallel_size,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint (``torch.load(weights_only=True)`` reads it); ``flops_known`` is redundant
        with ``model_flops is not None`` and kept for readers of the checkpoint."""
        return {**asdict(self), "flops_known": self.model_flops is not None}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> WindowCounts:
        """Inverse of :meth:`to_dict`; missing keys take their defaults, ``flops_known: False`` unknown FLOPs."""

        def count(key: str) -> int | None:
            value = state.get(key, 0)
            return None if value is None else int(value)

        known = bool(state.get("flops_known", True))
        return cls(
            seconds=float(state.get("seconds", 0.0)),
            batches=int(state.get("batches", 0)),
            samples=count("samples"),
            tokens=count("tokens"),
            model_flops=count("model_flops") if known else None,
            hardware_flops=count("hardware_flops") if known else None,
        )


class TrainingWindow:
    """Training seconds and the counts of the micro-batches trained in them, over a window that opens, pauses (for
    validation), resumes and closes.

    Pure accounting: time comes from ``clock``, counts from the caller; nothing here knows a Trainer. Token counts
    given as 0-d device tensors (an attention mask's sum) are summed on the device and read back to the host only by
    :meth:`counts` (and so :meth:`close`), once per window, so adding a micro-batch never synchronises a step.

    Args:
        clock: seconds since an arbitrary origin (default ``time.perf_counter``; tests inject a fake).

    Example::

        window = TrainingWindow()
        window.start()
        window.add(samples=4, tokens=512, model_flops=6e9)
        rates = window.close().rates(world_size=8, peak_flops=989e12)
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Drop every count and stop the clock (closed: :meth:`start` opens it again)."""
        self._carried = WindowCounts()
        self._counts = WindowCounts()
        self._device_tokens: torch.Tensor | None = None
        self._start: float | None = None
        self._paused_at: float | None = None

    def restore(self, counts: WindowCounts) -> None:
        """Start from ``counts`` measured earlier (a checkpoint's open window): the clock stays closed, its seconds
        are carried."""
        self.reset()
        self._carried = counts

    @property
    def started(self) -> bool:
        """The clock has started (running or paused)."""
        return self._start is not None

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    @property
    def batches(self) -> int:
        """Micro-batches added (carried ones included)."""
        return self._carried.batches + self._counts.batches

    def start(self) -> None:
        """Start the clock now, unless it has started already."""
        if self._start is None:
            self._start = self._clock()

    def pause(self) -> None:
        """Stop counting time (validation) until :meth:`resume`; does nothing unless the clock runs."""
        if self._start is not None and self._paused_at is None:
            self._paused_at = self._clock()

    def resume(self) -> None:
        """Count time again after :meth:`pause`; the paused span is left out."""
        if self._paused_at is not None and self._start is not None:
            self._start += self._clock() - self._paused_at
        self._paused_at = None

    def seconds(self) -> float:
        """Training seconds so far: the carried ones, then from the start to now (paused: to the pause)."""
        if self._start is None:
            return self._carried.seconds
        now = self._paused_at if self._paused_at is not None else self._clock()
        return self._carried.seconds + now - self._start

    def add(
        self,
        samples: int | None,
        tokens: int | torch.Tensor | None,
        model_flops: int | None = 0,
        hardware_flops: int | None = None,
    ) -> None:
        """Count one micro-batch (``None``: unknown; ``hardware_flops`` defaults to ``model_flops``)."""
        c = self._counts
        host_tokens: int | None = 0
        if tokens is None or c.tokens is None:
            host_tokens, self._device_tokens = None, None
        elif isinstance(tokens, torch.Tensor):
            detached = tokens.detach()
            self._device_tokens = detached if self._device_tokens is None else self._device_tokens + detached
        else:
            host_tokens = int(tokens)
        # The constructor, not dataclasses.replace: this runs at every micro-batch and replace introspects the fields.
        self._counts = WindowCounts(
            c.seconds,
            c.batches + 1,
            _plus(c.samples, samples),
            _plus(c.tokens, host_tokens),
            _plus(c.model_flops, model_flops),
            _plus(c.hardware_flops, model_flops if hardware_flops is None else hardware_flops),
        )

    def counts(self) -> WindowCounts:
        """Everything so far, carried counts included; reads a device token counter back (one sync)."""
        if self._device_tokens is not None:
            device, self._device_tokens = self._device_tokens, None
            self._counts = replace(self._counts, tokens=_plus(self._counts.tokens, int(device.item())))
        return self._carried + replace(self._counts, seconds=self.seconds() - self._carried.seconds)

    def close(self) -> WindowCounts:
        """:meth:`counts`, then an empty window whose clock starts now (the next window follows without a gap)."""
        counts = self.counts()
        self.reset()
        self.start()
        return counts
