"""Autocast's copies of frozen weights, found by value: the index :class:`SavedTensorsCounter` consults.

A cast of a frozen parameter (the fp32 base weights of a LoRA/PEFT model under ``bf16-mixed``) has no autograd
history, so it can only be recognised by its values. The index samples 16 elements of each frozen weight once, keys the
weights by (shape, device, those samples cast to a half dtype), so a saved tensor costs one 16-element read to find its
candidate, which is then confirmed element by element in chunks (no weight-sized temporary).

Example::

    index = FrozenWeightIndex(model.parameters())
    index.holds_cast(saved)  # True for autocast's bf16 copy of a frozen weight
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["FrozenWeightIndex"]


# Autocast's lower-precision dtypes: the frozen-weight index is built for them when the counter is created.
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
# Elements read from a saved tensor to find its candidate weights: enough to tell trained weights apart.
_N_SAMPLES = 16
# Largest chunk a confirming comparison casts at once (2 MiB in half precision), however big the weight.
_CHUNK_NUMEL = 1 << 20


def _sample_positions(shape: torch.Size, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Indices of up to ``_N_SAMPLES`` elements spread evenly over a tensor of ``shape`` (one index tensor per dim)."""
    numel = shape.numel()
    k = min(_N_SAMPLES, numel)
    flat = torch.tensor([i * (numel - 1) // (k - 1) for i in range(k)] if k > 1 else [0], dtype=torch.long)
    return tuple(index.to(device) for index in torch.unravel_index(flat, shape))


def _fingerprint(sample: torch.Tensor) -> bytes:
    """The bytes of a small sampled tensor (one device-to-host copy)."""
    return bytes(sample.reshape(-1).cpu().view(torch.uint8).tolist())


def _chunks(t: torch.Tensor, w: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Matching slices of ``t`` and ``w`` (same shape) of at most ``_CHUNK_NUMEL`` elements: rows, or parts of a row."""
    if t.dim() == 0:
        yield t, w
        return
    row = t.numel() // t.shape[0]
    if row > _CHUNK_NUMEL:
        for i in range(t.shape[0]):
            yield from _chunks(t[i], w[i])
        return
    step = max(1, _CHUNK_NUMEL // row)
    for i in range(0, t.shape[0], step):
        yield t[i : i + step], w[i : i + step]


def _is_cast_of(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``t`` holds exactly ``p``'s values cast to ``t``'s dtype (same shape and device, plain tensors).

    Compared chunk by chunk, so the cast temporary stays under ``_CHUNK_NUMEL`` elements whatever the weight's size,
    with one device-to-host read at the end.
    """
    with torch.no_grad():
        differs = torch.zeros((), dtype=torch.bool, device=t.device)
        for t_chunk, w_chunk in _chunks(t, p.detach()):
            differs |= (t_chunk != w_chunk.to(t.dtype)).any()
        return not bool(differs)


class FrozenWeightIndex:
    """Frozen floating-point parameters keyed by (shape, device, a few sampled values cast to a target dtype).

    Only frozen parameters are indexed: a cast of a trainable one is traced through autograd
    (``saved_tensors.is_weight_copy``). Sharded (DTensor), quantized and meta parameters are left out: no collective,
    no dequantizing, no data. Values are sampled when the index is built (for autocast's dtypes; for another dtype
    when first asked).
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._weights: list[torch.Tensor] = []
        self._samples: list[torch.Tensor] = []
        self._positions: dict[tuple[torch.Size, torch.device], tuple[torch.Tensor, ...]] = {}
        self._by_dtype: dict[torch.dtype, dict[tuple[torch.Size, str, bytes], list[torch.Tensor]]] = {}
        self.shapes: set[tuple[torch.Size, str]] = set()
        with torch.no_grad():
            for p in params:
                w = p.detach()
                if p.requires_grad or type(w) is not torch.Tensor or not w.is_floating_point() or not w.numel():
                    continue
                if w.device.type == "meta" or w.layout is not torch.strided:
                    continue
                self._weights.append(w)
                self._samples.append(w[self.positions(w)])
                self.shapes.add((w.shape, str(w.device)))
        for dtype in _AUTOCAST_DTYPES:
            self._build(dtype)

    def positions(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The sampled elements' indices for ``t``'s shape and device (computed once per pair)."""
        key = (t.shape, t.device)
        if key not in self._positions:
            self._positions[key] = _sample_positions(t.shape, t.device)
        return self._positions[key]

    def _build(self, dtype: torch.dtype) -> dict[tuple[torch.Size, str, bytes], list[torch.Tensor]]:
        """Key every indexed weight that is not already of ``dtype`` by its samples cast to ``dtype``."""
        table: dict[tuple[torch.Size, str, bytes], list[torch.Tensor]] = {}
        casts = [(w, s) for w, s in zip(self._weights, self._samples) if w.dtype != dtype]
        for device in {str(w.device) for w, _ in casts}:
            on_device = [(w, s) for w, s in casts if str(w.device) == device]
            # One device-to-host copy for all of a device's samples.
            host = torch.cat([s.reshape(-1).to(dtype) for _, s in on_device]).cpu()
            start = 0
            for w, s in on_device:
                fingerprint = _fingerprint(host[start : start + s.numel()])
                start += s.numel()
                table.setdefault((w.shape, device, fingerprint), []).append(w)
        self._by_dtype[dtype] = table
        return table

    def candidates(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Indexed weights whose sampled values, cast to ``t``'s dtype, equal ``t``'s (one small read of ``t``)."""
        table = self._by_dtype[t.dtype] if t.dtype in self._by_dtype else self._build(t.dtype)
        with torch.no_grad():
            fingerprint = _fingerprint(t[self.positions(t)])
        return table.get((t.shape, str(t.device), fingerprint), [])

    def holds_cast(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a plain tensor, not a view) is exactly one indexed weight cast to ``t``'s dtype."""
        if (t.shape, str(t.device)) not in self.shapes:
            return False
        return any(_is_cast_of(t, w) for w in self.candidates(t))
