"""The one place that touches private torch APIs, each behind a version/availability guard.

Nothing else in lightning_trainopt may call ``torch.cuda.memory._record_memory_history``, ``_dump_snapshot``,
``torch.cuda._get_nvml_device_index`` or read DDP's ``_comm_hooks`` / ``_get_ddp_logging_data``; when torch changes
them, only this file changes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ddp_comm_hook_name",
    "ddp_comm_hook_state",
    "dump_memory_snapshot",
    "memory_history_supported",
    "nvml_device_index",
    "start_memory_history",
    "stop_memory_history",
]


def memory_history_supported() -> bool:
    """CUDA allocator history can be recorded (a CUDA build, a visible device, and the private API present)."""
    return (
        torch.cuda.is_available()
        and hasattr(torch.cuda.memory, "_record_memory_history")
        and hasattr(torch.cuda.memory, "_dump_snapshot")
    )


def start_memory_history(max_entries: int = 100_000, stacks: str = "python") -> None:
    """Start recording allocator events (``torch.cuda.memory._record_memory_history``, torch >= 2.1 signature)."""
    if not memory_history_supported():
        raise RuntimeError("CUDA memory history needs a CUDA device and torch >= 2.1")
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries, stacks=stacks)  # type: ignore[arg-type]


def stop_memory_history() -> None:
    """Stop recording allocator events (no-op where unsupported)."""
    if memory_history_supported():
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded history as a pickle that https://pytorch.org/memory_viz opens."""
    if not memory_history_supported():
        raise RuntimeError("CUDA memory snapshots need a CUDA device and torch >= 2.1")
    torch.cuda.memory._dump_snapshot(path)


def nvml_device_index(device: Any) -> int:
    """NVML index of a CUDA device, honouring ``CUDA_VISIBLE_DEVICES`` (falls back to the CUDA index)."""
    index = torch.device(device).index if not isinstance(device, int) else device
    index = torch.cuda.current_device() if index is None else index
    getter = getattr(torch.cuda, "_get_nvml_device_index", None)
    return int(getter(index)) if getter is not None else int(index)


def ddp_comm_hook_name(ddp: Any) -> str | None:
    """Name of the communication hook already registered on a DDP module, or None.

    DDP keeps Python hooks in ``_comm_hooks`` and records every hook (built-in C++ ones too) in its logging data;
    a second registration raises inside the reducer, so callers check first.
    """
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        return getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
    logging_data = getattr(ddp, "_get_ddp_logging_data", None)
    if logging_data is not None:
        name = logging_data().get("comm_hook")
        if name:
            return str(name)
    return None


def ddp_comm_hook_state(ddp: Any) -> Any | None:
    """The state object of the Python communication hook registered on a DDP module (None if there is none)."""
    hooks = getattr(ddp, "_comm_hooks", None)
    return hooks[0][1] if hooks else None
