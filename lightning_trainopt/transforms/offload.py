"""Offload of activations saved for backward to (pinned) CPU memory, fetched back for backward."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightning_trainopt._compat.torch_internals import tensor_version
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import is_parameter_tensor

__all__ = ["CpuOffloader"]


class _Offloaded:
    """One saved tensor's CPU copy (the copy covers the whole storage, shared by all its saved views)."""

    __slots__ = ("__weakref__", "device", "host", "offset", "shape", "stride")

    def __init__(
        self, host: torch.Tensor, device: torch.device, shape: torch.Size, stride: tuple[int, ...], offset: int
    ):
        self.host, self.device, self.shape, self.stride, self.offset = host, device, shape, stride, offset

    def stored_tensors(self) -> tuple[torch.Tensor]:
        return (self.host,)


class CpuOffloader:
    """A saved-tensors transform that keeps accelerator activations in CPU memory until backward needs them.

    Tensors already on the CPU, parameters and storages below ``min_numel`` elements are kept as they are, so on
    a CPU-only run nothing changes (the callback says so and switches itself off).

    Args:
        pin_memory: copy into page-locked memory, so the copies overlap with compute (``non_blocking``).
        min_numel: smallest storage worth moving.
        key_prefix: prefix of the config keys in error messages.

    Raises:
        ConfigError: ``min_numel`` is not a positive integer.
    """

    def __init__(
        self, pin_memory: bool = True, min_numel: int = 1024, key_prefix: str = "activations.activation_offload"
    ) -> None:
        if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 1:
            raise ConfigError(f"{key_prefix}.min_numel", min_numel, "use a positive integer.")
        self.pin_memory = pin_memory
        self.min_numel = min_numel
        self._cache: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}
        self.n_offloaded = 0
        self.n_shared = 0
        self.n_passed = 0
        self.bytes_offloaded = 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "cpu" or is_parameter_tensor(t):
            self.n_passed += 1
            return t
        storage = t.untyped_storage()
        n = storage.nbytes() // t.element_size()
        if n < self.min_numel:
            self.n_passed += 1
            return t
        key = (t.device, storage.data_ptr(), t.dtype, tensor_version(t))
        entry = self._cache.get(key)
        found = entry[0]() if entry is not None and entry[1]() is not None else None
        if found is not None:
            self.n_shared += 1
            return _Offloaded(found, t.device, t.shape, t.stride(), int(t.storage_offset()))
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,)).detach()
        host = torch.empty(n, dtype=t.dtype, pin_memory=self.pin_memory)
        host.copy_(flat, non_blocking=self.pin_memory)
        packed = _Offloaded(host, t.device, t.shape, t.stride(), int(t.storage_offset()))
        self._cache = {k: v for k, v in self._cache.items() if v[0]() is not None and v[1]() is not None}
        self._cache[key] = (weakref.ref(host), weakref.ref(storage))
        self.n_offloaded += 1
        self.bytes_offloaded += host.numel() * host.element_size()
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Offloaded):
            flat = packed.host.to(packed.device, non_blocking=self.pin_memory)
            return flat.as_strided(packed.shape, packed.stride, packed.offset)
        return packed
