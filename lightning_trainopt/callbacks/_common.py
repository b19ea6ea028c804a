"""Helpers shared by the measuring callbacks (not public)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

Clock = Callable[[], float]


def default_clock() -> float:
    return time.perf_counter()


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every logger of the Trainer, from global rank 0 only (no collective, no sync)."""
    if not trainer.is_global_zero or not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step if step is None else step)


def check_log_every(key: str, value: int | None) -> None:
    """Refuse a logging window that is not ``None`` or a positive integer (``key`` names it in the error)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        from lightning_trainopt.exceptions import ConfigError

        raise ConfigError(key, value, "use a positive integer (optimizer steps), or null for the Trainer's.")


def log_interval(trainer: pl.Trainer, own: int | None) -> int:
    """The callback's logging window in optimizer steps: its own, else the Trainer's ``log_every_n_steps``."""
    return max(1, own if own is not None else int(getattr(trainer, "log_every_n_steps", 50) or 50))


def on_cuda(pl_module: pl.LightningModule) -> bool:
    return pl_module.device.type == "cuda"


def find_callback(trainer: pl.Trainer, cls_name: str) -> Any | None:
    """The first callback of the Trainer whose class is named ``cls_name`` (avoids import cycles)."""
    for cb in getattr(trainer, "callbacks", []):
        if type(cb).__name__ == cls_name:
            return cb
    return None


def warn_off(name: str, why: str) -> None:
    """The one line a monitor prints when it switches itself off."""
    rank_zero_warn(f"{name} is off: {why}", category=UserWarning)


def json_safe(value: Any) -> Any:
    """Floats, ints, strings, None, lists and dicts of them (tensors become numbers)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    return value


class StepEdge:
    """Tells ``on_train_batch_end`` whether an optimizer step finished since the last call.

    Under gradient accumulation several batches end with the same ``trainer.global_step``; the monitors log and
    close their windows once per optimizer step, on the batch that moved it.
    """

    def __init__(self) -> None:
        self.last = -1

    def reset(self, trainer: pl.Trainer) -> None:
        """Start counting from the Trainer's current step (fit start, resume)."""
        self.last = trainer.global_step

    def crossed(self, trainer: pl.Trainer) -> bool:
        """True once per new ``global_step``."""
        if trainer.global_step == self.last:
            return False
        self.last = trainer.global_step
        return True
