"""Read what the resume check needs from the composed config, so that ``checkpoint/`` takes plain values."""

from __future__ import annotations

from omegaconf import DictConfig

from lightning_trainopt.checkpoint.resume_check import check_resume

__all__ = ["check_resume_from_cfg"]

_FINDER = "lightning_trainopt.callbacks.MicroBatchFinder"


def check_resume_from_cfg(cfg: DictConfig, ckpt_path: str, data_parallel_size: int | None) -> None:
    """:func:`~lightning_trainopt.checkpoint.resume_check.check_resume` with ``data.batch_size`` and the ranks of
    the data-parallel size of the run's :class:`~lightning_trainopt.parallel.dims.ParallelDims` (``None``: unknown);
    the micro-batch counts as unknown when ``MicroBatchFinder`` chooses it at run time.

    Raises:
        ConfigError: mid-epoch with another global batch, naming ``data.batch_size`` and the value that resumes.
    """
    callbacks = cfg.get("callbacks") or {}
    chosen_at_run_time = any(str((node or {}).get("_target_", "")) == _FINDER for node in callbacks.values())
    batch = None if chosen_at_run_time else cfg.data.get("batch_size")
    check_resume(ckpt_path, batch, data_parallel_size)
