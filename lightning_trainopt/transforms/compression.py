"""8-bit compression of activations saved for backward (int8 values with one scale per block of elements)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_trainopt._compat.torch_internals import collective_result, tensor_version
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import is_parameter_tensor

__all__ = [
    "Int8Compressor",
    "QuantizedTensor",
    "dequantize_blockwise",
    "gradient_relative_error",
    "quantize_blockwise",
]


@dataclass(eq=False)
class QuantizedTensor:
    """A tensor stored as int8 codes and one fp32 absmax scale per block (the codes are padded to whole blocks)."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def stored_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.scales

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def quantize_blockwise(x: torch.Tensor, block_size: int = 64) -> QuantizedTensor:
    """Symmetric absmax int8 quantisation of ``x`` in blocks of ``block_size`` consecutive elements."""
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, block_size)
    scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    codes = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(codes=codes, scales=scales, shape=x.shape, dtype=x.dtype)


def dequantize_blockwise(q: QuantizedTensor) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise` (up to rounding)."""
    n = 1
    for d in q.shape:
        n *= d
    flat = (q.codes.float() * q.scales[:, None]).reshape(-1)[:n]
    return flat.view(q.shape).to(q.dtype)


class _Packed:
    """What the graph keeps for one saved tensor: its whole storage, quantised, shared by every view of it."""

    __slots__ = ("__weakref__", "offset", "shape", "storage", "stride")

    def __init__(self, storage: QuantizedTensor, shape: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.storage, self.shape, self.stride, self.offset = storage, shape, stride, offset

    def stored_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage.stored_tensors()


class _PackedShard:
    """What the graph keeps for one saved DTensor (tensor parallelism): its local shard as the transform stored it,
    and the mesh, placements, shape and stride that make the DTensor whole again."""

    __slots__ = ("local", "mesh", "placements", "shape", "stride")

    def __init__(self, local: Any, t: Any) -> None:
        self.local = local
        self.mesh, self.placements, self.shape, self.stride = t.device_mesh, t.placements, t.shape, t.stride()

    def stored_tensors(self) -> tuple[torch.Tensor, ...]:
        if isinstance(self.local, torch.Tensor):
            return (self.local,)
        return tuple(self.local.stored_tensors())

    def restore(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def _dtensor_type() -> type | None:
    """torch's ``DTensor`` class, ``None`` where torch is built without distributed support."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


class Int8Compressor:
    """A saved-tensors transform storing floating-point activations as int8 with per-block scales.

    The unit of compression is the tensor's whole storage, so every view of one storage that autograd saves
    (a block's normalised input feeds q, k and v; ``q`` and its transpose) shares one int8 copy, and the original
    storage can be freed. Parameters (and views of them), integer tensors and storages below ``min_numel``
    elements are kept as they are.

    Storages holding a non-finite value or any value of magnitude at least ``max_abs`` are kept as they are too:
    an ``inf`` makes its block's scale infinite and every value of the block NaN after the round trip, and a
    mask value such as ``finfo.min`` or ``-1e9`` (attention scores, masked logits before ``log_softmax``) rounds
    the other values of its block to zero. The check costs one ``aminmax`` reduction over each saved storage not
    already compressed and, on an accelerator, one host synchronisation per such storage (``n_out_of_range``
    counts the saved tensors kept for this reason).

    Args:
        bits: only 8 is implemented.
        block_size: elements per scale (smaller: more accurate, more scale bytes: ``4 / block_size`` B/element).
        min_numel: smallest storage worth compressing.
        max_abs: storages with a value of at least this magnitude are not compressed (default 1e4, the mask value
            of fp16 code; real activations stay far below it).
        key_prefix: prefix of the config keys in error messages.

    Raises:
        ConfigError: ``bits`` is not 8, a size is not a positive integer, or ``max_abs`` is not positive.
    """

    def __init__(
        self,
        bits: int = 8,
        block_size: int = 64,
        min_numel: int = 1024,
        max_abs: float = 1e4,
        key_prefix: str = "activations.activation_compression",
    ) -> None:
        if bits != 8:
            raise ConfigError(f"{key_prefix}.bits", bits, "only bits=8 is implemented (int8 codes, fp32 block scales).")
        for key, value in (("block_size", block_size), ("min_numel", min_numel)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key_prefix}.{key}", value, "use a positive integer.")
        if isinstance(max_abs, bool) or not isinstance(max_abs, (int, float)) or not 0 < max_abs < math.inf:
            raise ConfigError(f"{key_prefix}.max_abs", max_abs, "use a positive finite magnitude, e.g. 1e4.")
        self.bits = bits
        self.max_abs = float(max_abs)
        self.block_size = block_size
        self.min_numel = min_numel
        # storage key -> (weak ref to the quantised copy, weak ref to the original storage). torch keeps one Python
        # object per live storage; an entry is valid only while it lives, otherwise the address may have been reused.
        self._cache: dict[tuple[Any, ...], tuple[weakref.ref[QuantizedTensor], weakref.ref[Any]]] = {}
        self.n_compressed = 0
        self.n_shared = 0
        self.n_passed = 0
        self.n_out_of_range = 0

    def _flat_storage(self, t: torch.Tensor) -> torch.Tensor | None:
        if not t.is_floating_point() or is_parameter_tensor(t):
            return None
        storage = t.untyped_storage()
        n = storage.nbytes() // t.element_size()
        if n < self.min_numel:
            return None
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))

    def _in_range(self, flat: torch.Tensor) -> bool:
        lo, hi = torch.stack(torch.aminmax(flat.detach())).tolist()  # NaN propagates; one sync
        return math.isfinite(lo) and math.isfinite(hi) and max(-lo, hi) < self.max_abs

    def pack(self, t: torch.Tensor) -> Any:
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(t, dtensor):
            # Autograd saves a tensor-parallel layer's activations as DTensors (it records the graph above DTensor's
            # dispatch), whose storage is their local shard's: compress the shard, rebuild the DTensor in unpack.
            if not t.is_floating_point() or is_parameter_tensor(t):
                self.n_passed += 1
                return t
            shard: Any = t.detach()
            with torch.no_grad():
                local = shard.to_local()
            return _PackedShard(self._pack_local(collective_result(local)), t)
        return self._pack_local(collective_result(t))

    def _pack_local(self, t: torch.Tensor) -> Any:
        flat = self._flat_storage(t)
        if flat is None:
            self.n_passed += 1
            return t
        key = (t.device, flat.data_ptr(), t.dtype, tensor_version(t))
        entry = self._cache.get(key)
        quantized = entry[0]() if entry is not None and entry[1]() is not None else None
        if quantized is None:
            if not self._in_range(flat):
                self.n_out_of_range += 1
                self.n_passed += 1
                return t
            quantized = quantize_blockwise(flat, self.block_size)
            self._cache = {k: v for k, v in self._cache.items() if v[0]() is not None and v[1]() is not None}
            self._cache[key] = (weakref.ref(quantized), weakref.ref(t.untyped_storage()))
            self.n_compressed += 1
        else:
            self.n_shared += 1
        return _Packed(quantized, t.shape, t.stride(), int(t.storage_offset()))

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _PackedShard):
            return packed.restore(self.unpack(packed.local))
        if isinstance(packed, _Packed):
            return dequantize_blockwise(packed.storage).as_strided(packed.shape, packed.stride, packed.offset)
        return packed


def gradient_relative_error(reference: Iterable[torch.Tensor | None], other: Iterable[torch.Tensor | None]) -> float:
    """``||g - g_ref|| / ||g_ref||`` over all gradients concatenated (``None`` gradients are skipped in pairs)."""
    num = torch.zeros((), dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    for ref, got in zip(reference, other, strict=True):
        if ref is None or got is None:
            if (ref is None) != (got is None):
                raise ValueError("one run has a gradient where the other has none")
            continue
        num += (got.double() - ref.double()).pow(2).sum()
        den += ref.double().pow(2).sum()
    return float((num.sqrt() / den.sqrt()).item()) if den > 0 else 0.0
