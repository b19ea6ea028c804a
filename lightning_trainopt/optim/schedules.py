"""Learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from lightning_trainopt.exceptions import ConfigError

__all__ = ["DEFAULT_WARMUP_RATIO", "check_warmup_cosine", "peak_lr", "resolve_warmup_steps", "warmup_cosine_factor"]

# Warmup when neither warmup_steps nor warmup_ratio is given: 10 steps of the Quickstart's 300, 0 of a run under 30.
DEFAULT_WARMUP_RATIO = 0.034


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_warmup_cosine(
    warmup_steps: Any,
    total_steps: Any,
    min_lr_ratio: Any,
    prefix: str = "scheduler",
    warmup_ratio: Any = None,
) -> None:
    """Raise :class:`ConfigError` for a warmup-cosine setting that cannot make a schedule.

    Args:
        warmup_steps: an integer >= 0, or ``None`` for a warmup given as a fraction of the run.
        total_steps: an integer > ``warmup_steps``, or ``None`` when it is not known yet (checked later).
        min_lr_ratio: a number in ``[0, 1]``.
        prefix: the config node the keys belong to (``scheduler``, ``callbacks.warmup_cosine_lr``).
        warmup_ratio: a fraction in ``[0, 1)`` of ``total_steps``, or ``None``; at most one of ``warmup_steps``
            and ``warmup_ratio`` may be given (neither: :data:`DEFAULT_WARMUP_RATIO`).

    Raises:
        ConfigError: the first invalid value, naming its key.
    """
    if warmup_steps is not None and warmup_ratio is not None:
        raise ConfigError(
            f"{prefix}.warmup_ratio",
            warmup_ratio,
            f"{prefix}.warmup_steps={warmup_steps!r} is given too; give one of the two "
            f"(steps win over the default ratio), e.g. set {prefix}.warmup_ratio=null.",
        )
    if warmup_steps is not None and (not _is_int(warmup_steps) or warmup_steps < 0):
        raise ConfigError(f"{prefix}.warmup_steps", warmup_steps, "use an integer >= 0 (optimizer steps), or null.")
    if warmup_ratio is not None and not (_is_number(warmup_ratio) and 0.0 <= warmup_ratio < 1.0):
        text = " (a number, not a string)" if isinstance(warmup_ratio, str) else ""
        raise ConfigError(
            f"{prefix}.warmup_ratio",
            warmup_ratio,
            f"use a fraction of the run's optimizer steps in [0, 1){text}, e.g. 0.03, or null.",
        )
    ratio_ok = _is_number(min_lr_ratio)
    if not ratio_ok or not 0.0 <= min_lr_ratio <= 1.0:
        text = " (a number, not a string)" if isinstance(min_lr_ratio, str) else ""
        raise ConfigError(f"{prefix}.min_lr_ratio", min_lr_ratio, f"use a ratio between 0 and 1{text}, e.g. 0.1.")
    if total_steps is None:
        return
    if not _is_int(total_steps) or total_steps < 1:
        raise ConfigError(f"{prefix}.total_steps", total_steps, "use an integer >= 1 (optimizer steps).")
    if warmup_steps is not None and warmup_steps >= total_steps:
        raise ConfigError(
            f"{prefix}.warmup_steps",
            warmup_steps,
            f"warmup must be shorter than the {total_steps} optimizer steps of the run; "
            f"lower it, raise trainer.max_steps, or give the warmup as a fraction: {prefix}.warmup_steps=null "
            f"{prefix}.warmup_ratio=0.03.",
        )


def resolve_warmup_steps(warmup_steps: int | None, warmup_ratio: float | None, total_steps: int) -> int:
    """Warmup steps of a run of ``total_steps``: ``warmup_steps`` if given, else the whole steps of the ratio.

    The ratio (default :data:`DEFAULT_WARMUP_RATIO`) is rounded down, so the warmup is shorter than any run of at
    least one step (a 1-step run has none). It is taken as the decimal it was written as (``0.29`` of 100 is 29,
    where the float product is 28.999...). Call :func:`check_warmup_cosine` first.
    """
    if warmup_steps is not None:
        return warmup_steps
    ratio = DEFAULT_WARMUP_RATIO if warmup_ratio is None else warmup_ratio
    return math.floor(Fraction(str(ratio)) * total_steps)


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warmup from ``1/(warmup_steps)`` to 1 over ``warmup_steps`` steps, then cosine decay from 1 to
    ``min_lr_ratio`` over the remaining ``total_steps - warmup_steps`` steps; the floor holds after that.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def peak_lr(param_group: dict[str, Any]) -> float:
    """The learning rate a parameter group was configured with, not the one a schedule has set for this step.

    torch's ``LRScheduler`` keeps the configured rate as ``initial_lr`` and overwrites ``lr`` every step (during
    warmup the first step's ``lr`` is a small fraction of it); without a scheduler the two are the same.
    """
    return float(param_group.get("initial_lr", param_group["lr"]))
