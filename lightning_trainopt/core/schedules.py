"""Learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math
from typing import Any

from lightning_trainopt.exceptions import ConfigError

__all__ = ["check_warmup_cosine", "warmup_cosine_factor"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_warmup_cosine(warmup_steps: Any, total_steps: Any, min_lr_ratio: Any, prefix: str = "scheduler") -> None:
    """Raise :class:`ConfigError` for a warmup-cosine setting that cannot make a schedule.

    Args:
        warmup_steps: an integer >= 0.
        total_steps: an integer > ``warmup_steps``, or ``None`` when it is not known yet (checked later).
        min_lr_ratio: a number in ``[0, 1]``.
        prefix: the config node the keys belong to (``scheduler``, ``callbacks.warmup_cosine_lr``).
    """
    if not _is_int(warmup_steps) or warmup_steps < 0:
        raise ConfigError(f"{prefix}.warmup_steps", warmup_steps, "use an integer >= 0 (optimizer steps).")
    ratio_ok = isinstance(min_lr_ratio, (int, float)) and not isinstance(min_lr_ratio, bool)
    if not ratio_ok or not 0.0 <= min_lr_ratio <= 1.0:
        text = " (a number, not a string)" if isinstance(min_lr_ratio, str) else ""
        raise ConfigError(f"{prefix}.min_lr_ratio", min_lr_ratio, f"use a ratio between 0 and 1{text}, e.g. 0.1.")
    if total_steps is None:
        return
    if not _is_int(total_steps) or total_steps < 1:
        raise ConfigError(f"{prefix}.total_steps", total_steps, "use an integer >= 1 (optimizer steps).")
    if warmup_steps >= total_steps:
        raise ConfigError(
            f"{prefix}.warmup_steps",
            warmup_steps,
            f"warmup must be shorter than the {total_steps} optimizer steps of the run; "
            f"lower it or raise trainer.max_steps.",
        )


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warmup from ``1/(warmup_steps)`` to 1 over ``warmup_steps`` steps, then cosine decay from 1 to
    ``min_lr_ratio`` over the remaining ``total_steps - warmup_steps`` steps; the floor holds after that.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
