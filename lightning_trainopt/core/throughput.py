"""Throughput arithmetic: samples and tokens of a batch, and rates, MFU and HFU over a window of steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["BatchSize", "ThroughputWindow", "batch_size_of", "throughput"]


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
    """Rates over a window of micro-batches on one device, and the whole job (``world_size`` devices).

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
) -> ThroughputWindow:
    """Rates of one device over ``seconds`` in which it processed ``samples``/``tokens`` and ``*_flops``.

    Totals assume every rank runs the same number of micro-batches in the window (data parallelism).
    MFU = model FLOP/s / peak; HFU counts recomputation too. Both are ``None`` without a peak. Unknown counts
    (``None``) give ``None`` rates.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if not seconds > 0:
        raise ValueError(f"a throughput window needs a positive duration, got {seconds}")
    tflops = None if model_flops is None else model_flops / seconds / 1e12
    mfu = None if model_flops is None or not peak_flops else model_flops / seconds / peak_flops
    hfu_flops = hardware_flops if hardware_flops is not None else model_flops
    hfu = None if hfu_flops is None or not peak_flops else hfu_flops / seconds / peak_flops
    return ThroughputWindow(
        seconds=seconds,
        samples_per_s=None if samples is None else samples / seconds,
        tokens_per_s=None if tokens is None else tokens / seconds,
        samples_per_s_total=None if samples is None else samples * world_size / seconds,
        tokens_per_s_total=None if tokens is None else tokens * world_size / seconds,
        tflops_per_s=tflops,
        mfu=mfu,
        hfu=hfu,
    )
