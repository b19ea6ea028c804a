"""Resuming from a checkpoint: what can be checked against the saved state before any process starts."""

from __future__ import annotations

from omegaconf import DictConfig

from lightning_trainopt.checkpoint.state import saved_loader_states
from lightning_trainopt.data.resumable_loader import STATE_VERSION, check_global_batch

__all__ = ["check_resume"]

_FINDER = "lightning_trainopt.callbacks.MicroBatchFinder"


def check_resume(cfg: DictConfig, ckpt_path: str, data_parallel_size: int | None) -> None:
    """Refuse a resume that the checkpoint's training-loader position cannot continue, before anything is spawned.

    A run stopped mid-epoch continues exactly only with the global batch it was read with (micro-batch x
    data-parallel ranks; :func:`~lightning_trainopt.data.resumable_loader.check_global_batch`). The loader checks
    the rest (the same data and shuffle) once the data is read. Nothing is checked when the micro-batch is chosen at
    run time (``MicroBatchFinder``) or the ranks are not known from the config.

    Args:
        cfg: the composed config (``data.batch_size``, ``callbacks``).
        ckpt_path: the checkpoint to resume.
        data_parallel_size: the run's data-parallel replicas (``ParallelDims.dp`` from the config); ``None``:
            unknown, nothing is checked.

    Raises:
        ConfigError: mid-epoch with another global batch, naming ``data.batch_size`` and the value that resumes.
    """
    callbacks = cfg.get("callbacks") or {}
    if any(str((node or {}).get("_target_", "")) == _FINDER for node in callbacks.values()):
        return
    ranks = data_parallel_size
    batch = cfg.data.get("batch_size")
    if ranks is None or not isinstance(batch, int):
        return
    for state in saved_loader_states(ckpt_path):
        if state.get("version") == STATE_VERSION:
            check_global_batch(state, batch, ranks, "data")
