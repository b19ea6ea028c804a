"""Resuming from a checkpoint: what can be checked against the saved state before any process starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_trainopt.checkpoint.state import saved_loader_states
from lightning_trainopt.data.resumable_loader import STATE_VERSION, check_global_batch

__all__ = ["check_resume", "finished_training"]


def check_resume(ckpt_path: str, batch_size: int | None, ranks: int | None) -> None:
    """Refuse a resume that the checkpoint's training-loader position cannot continue, before anything is spawned.

    A run stopped mid-epoch continues exactly only with the global batch it was read with (micro-batch x
    data-parallel ranks; :func:`~lightning_trainopt.data.resumable_loader.check_global_batch`). The loader checks
    the rest (the same data and shuffle) once the data is read. ``train.py`` passes the run
    spec's values (``RunSpec.data.fixed_batch_size``, ``RunSpec.parallelism.dims``).

    Args:
        ckpt_path: the checkpoint to resume from.
        batch_size: ``data.batch_size``; ``None`` when the micro-batch is chosen at run time (``MicroBatchFinder``):
            nothing is checked then.
        ranks: the data-parallel size (``ParallelDims.dp``); ``None`` when not known from the config:
            nothing is checked then.

    Args:
        cfg: the composed config (``data.batch_size``, ``callbacks``).
        ckpt_path: the checkpoint to resume.
        data_parallel_size: the run's data-parallel replicas (``ParallelDims.dp`` from the config); ``None``:
            unknown, nothing is checked.

    Raises:
        ConfigError: mid-epoch with another global batch, naming ``data.batch_size`` and the value that resumes.
    """
    if ranks is None or not isinstance(batch_size, int):
        return
    for state in saved_loader_states(ckpt_path):
        if state.get("version") == STATE_VERSION:
            check_global_batch(state, batch_size, ranks, "data")


def finished_training(state: Mapping[str, Any], trainer: Mapping[str, Any]) -> str | None:
    """Why a checkpoint has nothing left to train under the ``trainer`` node, e.g. ``step 60 of max_steps=60``.

    ``None`` when the fit would continue: ``max_steps`` (if set) is not reached and ``max_epochs`` (if set) not
    completed. Resuming a finished run (a retry after pre-emption, the same command again) would train no step and
    overwrite its results; the caller keeps them instead.

    Args:
        state: Lightning's state in the checkpoint (:func:`~lightning_trainopt.checkpoint.state.lightning_state`).
        trainer: the run's ``trainer`` arguments (``RunSpec.trainer.options``).
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
