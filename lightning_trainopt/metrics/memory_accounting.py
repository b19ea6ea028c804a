"""Per-rank bytes of parameters, gradients and optimizer states, by where they live (device, CPU, NVMe).

Counts what *this process* holds: ZeRO and FSDP2 partitions by their local shard, DeepSpeed's fp32 master
partitions as optimizer state (the textbook "12 bytes/param" of mixed-precision Adam = fp32 master + two moments),
offload buffers as ``cpu``, swap files as ``nvme``. Each storage is counted once even when several tensors view it.

Placement: a tensor on a different device type than the compute device is ``cpu``. When the compute device *is*
the CPU (a CPU-only run), a category the strategy offloads (``offload``) is ``cpu`` and the rest ``device``, so the
figures mean on CPU what they mean on a GPU. Communication buckets (DeepSpeed's reduce/all-gather buffers) are not
counted: they are sized by ``reduce_bucket_size``, not by the model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["MemoryBreakdown", "Placement", "memory_breakdown", "tensor_leaves", "textbook_bytes_per_param"]

_CATEGORIES = ("params", "grads", "optimizer_states")


@dataclass
class Placement:
    """Bytes of one category on the compute device, in CPU memory and in NVMe swap files."""

    device: int = 0
    cpu: int = 0
    nvme: int = 0

    @property
    def total(self) -> int:
        return self.device + self.cpu + self.nvme


@dataclass
class MemoryBreakdown:
    """Bytes this rank holds for parameters, gradients and optimizer states.

    Example::

        mb = memory_breakdown(model, [optimizer], compute_device="cpu")
        mb.to_dict()["params"]["device"]
    """

    params: Placement = field(default_factory=Placement)
    grads: Placement = field(default_factory=Placement)
    optimizer_states: Placement = field(default_factory=Placement)

    def to_dict(self) -> dict[str, dict[str, int]]:
        """``{"params": {"device", "cpu", "nvme"}, "grads": ..., "optimizer_states": ...}`` in bytes (JSON-safe)."""
        return {name: asdict(getattr(self, name)) for name in _CATEGORIES}

    @property
    def total(self) -> int:
        return sum(getattr(self, name).total for name in _CATEGORIES)


def textbook_bytes_per_param(mixed_precision: bool) -> dict[str, int]:
    """Adam's model-state bytes per parameter on one unsharded rank (ZeRO paper, Rajbhandari et al. 2020).

    Mixed precision: 2 (half weights) + 2 (half gradients) + 12 (fp32 master, momentum, variance);
    fp32: 4 + 4 + 8.
    """
    if mixed_precision:
        return {"params": 2, "grads": 2, "optimizer_states": 12}
    return {"params": 4, "grads": 4, "optimizer_states": 8}


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 / tensor-parallel DTensors: only the local shard lives on this rank.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes.

    Tensor subclasses that wrap other tensors (torchao's low-bit optimizer states keep ``codes``, ``scale`` and
    ``qmap``) have no storage of their own to read (``untyped_storage().data_ptr()`` raises); they are flattened
    through ``__tensor_flatten__`` into their inner tensors, recursively. Plain tensors and parameters yield themselves.
    """
    flatten = getattr(t, "__tensor_flatten__", None)
    # type(), not isinstance: a Parameter made from a subclass (torchao's FP8 weight under FSDP2) is an instance of
    # Parameter but keeps the subclass type, and has no storage of its own either.
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = flatten()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from tensor_leaves(inner)
    else:
        yield t


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class _Counter:
    def __init__(self, compute_type: str, offload: dict[str, str]) -> None:
        self.compute_type = compute_type
        self.offload = offload
        self.seen: set[tuple[str, int]] = set()
        self.result = MemoryBreakdown()

    def add(self, category: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        for leaf in tensor_leaves(_local(tensor)):
            self._add_plain(category, leaf)

    def _add_plain(self, category: str, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = (str(t.device), storage.data_ptr())
        if key in self.seen:
            return
        self.seen.add(key)
        place: Placement = getattr(self.result, category)
        offloaded = self.compute_type == "cpu" and self.offload.get(category, "none") != "none"
        if t.device.type != self.compute_type or offloaded:
            place.cpu += nbytes
        else:
            place.device += nbytes

    def add_nvme(self, category: str, nbytes: int) -> None:
        getattr(self.result, category).nvme += nbytes


def _folder_bytes(folder: str | None) -> int:
    if not folder or not os.path.isdir(folder):
        return 0
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


def _param_tensors(p: torch.nn.Parameter) -> Iterator[torch.Tensor]:
    ds_tensor = getattr(p, "ds_tensor", None)
    if ds_tensor is not None:
        # ZeRO-3: the local partition, plus the full tensor only while it is gathered (persistent small params).
        yield ds_tensor
    yield p.data if not hasattr(p, "to_local") else p


def _deepspeed_optimizer_parts(ds_opt: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """(fp32 master partitions, gradient partitions, wrapped torch optimizer) of a DeepSpeed ZeRO optimizer."""
    masters: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        masters.extend(t for t in getattr(ds_opt, name, None) or [] if isinstance(t, torch.Tensor))
    grads.extend(m.grad for m in masters if m.grad is not None)
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        buf = getattr(ds_opt, name, None)
        if isinstance(buf, torch.Tensor):
            grads.append(buf)
    averaged = getattr(ds_opt, "averaged_gradients", None)
    if isinstance(averaged, dict):
        grads.extend(_tensors(list(averaged.values())))
    return masters, grads, getattr(ds_opt, "optimizer", None)


def _swap_folders(ds_opt: Any) -> tuple[str | None, str | None]:
    opt_swapper = getattr(ds_opt, "optimizer_swapper", None)
    param_coordinator = getattr(ds_opt, "parameter_offload", None)
    param_swapper = (
        getattr(getattr(param_coordinator, "module", None), "ds_param_swapper", None) if param_coordinator else None
    )
    opt_folder = getattr(opt_swapper, "swap_folder", None)
    param_folder = getattr(param_swapper, "swap_folder", None)
    return opt_folder, param_folder


def memory_breakdown(
    module: torch.nn.Module,
    optimizers: Iterable[Any],
    compute_device: torch.device | str,
    offload: dict[str, str] | None = None,
    nvme_folders: dict[str, str] | None = None,
) -> MemoryBreakdown:
    """Bytes of parameters, gradients and optimizer states held by this process.

    Args:
        module: the model (a DeepSpeed engine's ``module``, an FSDP2-sharded module, or a plain one).
        optimizers: the optimizers in use; DeepSpeed ZeRO optimizers are unwrapped (fp32 master partitions count
            as optimizer state, their gradient partitions as gradients).
        compute_device: the device the strategy computes on (``cuda:0``, ``cpu``).
        offload: what the strategy offloads: ``{"params": "cpu"|"nvme"|"none", "optimizer_states": ...}``;
            ``grads`` follow ``optimizer_states`` (DeepSpeed offload keeps gradient partitions with the optimizer).
        nvme_folders: swap folders whose file sizes count as ``nvme`` (``{"params": path, "optimizer_states": path}``);
            found automatically for DeepSpeed ZeRO-3 swappers.
    """
    compute_type = torch.device(compute_device).type
    off = {"params": "none", "optimizer_states": "none", **(offload or {})}
    off.setdefault("grads", off["optimizer_states"])
    counter = _Counter(compute_type, off)
    folders = dict(nvme_folders or {})

    for p in module.parameters():
        for t in _param_tensors(p):
            counter.add("params", t)
    for p in module.parameters():
        counter.add("grads", p.grad)

    for opt in optimizers:
        masters, grads, inner = _deepspeed_optimizer_parts(opt)
        for g in grads:
            counter.add("grads", g)
        for m in masters:
            counter.add("optimizer_states", m)
        if masters:
            opt_folder, param_folder = _swap_folders(opt)
            if opt_folder:
                folders.setdefault("optimizer_states", opt_folder)
            if param_folder:
                folders.setdefault("params", param_folder)
        base = inner if masters and inner is not None else opt
        state = getattr(base, "state", {})
        for t in _tensors(list(state.values()) if isinstance(state, dict) else []):
            counter.add("optimizer_states", t)

    for category, folder in folders.items():
        counter.add_nvme(category, _folder_bytes(folder))
    return counter.result
