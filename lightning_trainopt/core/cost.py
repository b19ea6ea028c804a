"""Dollar arithmetic of a run: spent, per billion tokens, projected, and lost to idle or stalled time."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CostReport", "cost_report"]


@dataclass(frozen=True)
class CostReport:
    """Cost of a run so far and projected. Dollar fields are ``None`` when no price is known; per-token (per-sample)
    figures are ``None`` when the batches could not be sized."""

    device_hours: float
    dollars: float | None
    dollars_per_1b_tokens: float | None
    dollars_per_1m_samples: float | None
    projected_seconds_left: float | None
    projected_total_dollars: float | None
    idle_fraction: float | None
    dollars_lost_idle: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cost_report(
    elapsed_s: float,
    devices: int,
    price_per_device_hour: float | None,
    tokens: int | None,
    steps_done: int = 0,
    steps_total: int | None = None,
    tokens_target: int | None = None,
    idle_fraction: float | None = None,
    samples: int | None = None,
) -> CostReport:
    """Dollars of ``devices`` devices over ``elapsed_s`` seconds, and the projection to the end of the run.

    Args:
        elapsed_s: wall-clock seconds of training so far.
        devices: devices billed (world size).
        price_per_device_hour: dollars per device-hour, or ``None``.
        tokens: tokens trained on so far, all devices together; ``None`` if unknown (no per-token figures, no
            projection to ``tokens_target``).
        steps_done, steps_total: optimizer steps done and planned (``trainer.max_steps``), for the projection.
        tokens_target: alternatively, a token budget; used when given.
        idle_fraction: share of wall time the devices were idle or stalled (from StepTimer / GPUMonitor).
        samples: samples trained on so far, all devices together, or ``None``.

    Raises:
        ValueError: negative time or fewer than one device.
    """
    if elapsed_s < 0 or devices < 1:
        raise ValueError(f"elapsed_s={elapsed_s} must be >= 0 and devices={devices} >= 1")
    hours = elapsed_s / 3600 * devices
    dollars = None if price_per_device_hour is None else hours * price_per_device_hour
    per_1b = None if dollars is None or not tokens else dollars / tokens * 1e9
    per_1m_samples = None if dollars is None or not samples else dollars / samples * 1e6
    left: float | None = None
    if tokens_target is not None:  # the user's target: no projection at all rather than one to another end
        left = max(0.0, elapsed_s * (tokens_target - tokens) / tokens) if tokens else None
    elif steps_total is not None and steps_total > 0 and steps_done > 0:
        left = max(0.0, elapsed_s * (steps_total - steps_done) / steps_done)
    projected = (
        None if dollars is None or left is None else dollars * (elapsed_s + left) / elapsed_s if elapsed_s else None
    )
    lost = None if dollars is None or idle_fraction is None else dollars * idle_fraction
    return CostReport(hours, dollars, per_1b, per_1m_samples, left, projected, idle_fraction, lost)
