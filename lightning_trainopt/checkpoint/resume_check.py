"""Resuming from a checkpoint: what can be checked against the saved state before any process starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig

from lightning_trainopt.checkpoint.state import saved_loader_states
from lightning_trainopt.data.resumable_loader import STATE_VERSION, check_global_batch

__all__ = ["check_resume", "data_parallel_ranks", "finished_training"]

_FINDER = "lightning_trainopt.callbacks.MicroBatchFinder"


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


def check_resume(cfg: DictConfig, ckpt_path: str) -> None:
    """Refuse a resume that the checkpoint's training-loader position cannot continue, before anything is spawned.

    A run stopped mid-epoch continues exactly only with the global batch it was read with (micro-batch x
    data-parallel ranks; :func:`~lightning_trainopt.data.resumable_loader.check_global_batch`). The loader checks
    the rest (the same data and shuffle) once the data is read. Nothing is checked when the micro-batch is chosen at
    run time (``MicroBatchFinder``) or the ranks are not known from the config.

    Raises:
        ConfigError: mid-epoch with another global batch, naming ``data.batch_size`` and the value that resumes.
    """
    callbacks = cfg.get("callbacks") or {}
    if any(str((node or {}).get("_target_", "")) == _FINDER for node in callbacks.values()):
        return
    ranks = data_parallel_ranks(cfg.trainer)
    batch = cfg.data.get("batch_size")
    if ranks is None or not isinstance(batch, int):
        return
    for state in saved_loader_states(ckpt_path):
        if state.get("version") == STATE_VERSION:
            check_global_batch(state, batch, ranks, "data")


def finished_training(state: Mapping[str, Any], trainer: Any) -> str | None:
    """Why a checkpoint has nothing left to train under the ``trainer`` node, e.g. ``step 60 of max_steps=60``.

    ``None`` when the fit would continue: ``max_steps`` (if set) is not reached and ``max_epochs`` (if set) not
    completed. Resuming a finished run (a retry after pre-emption, the same command again) would train no step and
    overwrite its results; the caller keeps them instead.

    Args:
        state: Lightning's state in the checkpoint (:func:`~lightning_trainopt.checkpoint.state.lightning_state`).
        trainer: the config's ``trainer`` node.
    """
    step = state.get("global_step")
    max_steps = trainer.get("max_steps", -1)
    if isinstance(step, int) and isinstance(max_steps, int) and 0 <= max_steps <= step:
        return f"step {step} of max_steps={max_steps}"
    max_epochs = trainer.get("max_epochs")
    loops = state.get("loops") or {}
    progress = ((loops.get("fit_loop") or {}).get("epoch_progress") or {}).get("current") or {}
    # Lightning's own test (FitLoop.done): `processed` is counted before on_train_epoch_end, where checkpoints are
    # saved, `completed` only after it.
    epochs = progress.get("processed")
    if isinstance(max_epochs, int) and isinstance(epochs, int) and 0 <= max_epochs <= epochs:
        return f"{epochs} epochs of max_epochs={max_epochs}"
    return None
