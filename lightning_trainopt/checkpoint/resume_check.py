"""Resuming from a checkpoint: what can be checked against the saved state before any process starts."""

from __future__ import annotations

from typing import Any

import torch

from lightning_trainopt.checkpoint.state import saved_loader_states
from lightning_trainopt.data.resumable_loader import STATE_VERSION, check_global_batch

__all__ = ["check_resume", "data_parallel_ranks"]


def data_parallel_ranks(trainer: Any) -> int | None:
    """The run's data-parallel ranks from the ``trainer`` node (``devices`` x ``num_nodes``); ``None`` if unknown.

    ``devices=auto``/``-1`` count the CUDA devices when the run uses them, else one CPU process.
    """
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if devices in ("auto", -1, "-1"):
        on_cpu = str(trainer.get("accelerator", "auto")) == "cpu" or not torch.cuda.is_available()
        devices = 1 if on_cpu else torch.cuda.device_count()
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or not isinstance(nodes, int) or devices < 1:
        return None
    return devices * nodes


def check_resume(ckpt_path: str, batch_size: int | None, ranks: int | None) -> None:
    """Refuse a resume that the checkpoint's training-loader position cannot continue, before anything is spawned.

    A run stopped mid-epoch continues exactly only with the global batch it was read with (micro-batch x
    data-parallel ranks; :func:`~lightning_trainopt.data.resumable_loader.check_global_batch`). The loader checks
    the rest (the same data and shuffle) once the data is read. The values are read from the config in
    ``config/resume.py``.

    Args:
        ckpt_path: the checkpoint to resume from.
        batch_size: ``data.batch_size``; ``None`` when the micro-batch is chosen at run time (``MicroBatchFinder``):
            nothing is checked then.
        ranks: the data-parallel ranks (:func:`data_parallel_ranks`); ``None`` when not known from the config:
            nothing is checked then.

    Raises:
        ConfigError: mid-epoch with another global batch, naming ``data.batch_size`` and the value that resumes.
    """
    if ranks is None or not isinstance(batch_size, int):
        return
    for state in saved_loader_states(ckpt_path):
        if state.get("version") == STATE_VERSION:
            check_global_batch(state, batch_size, ranks, "data")
