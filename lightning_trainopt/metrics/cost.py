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
    *,
    prior_device_hours: float = 0.0,
    prior_steps: int = 0,
    prior_tokens: int = 0,
) -> CostReport:
    """Dollars of a run so far (earlier runs before a resume included), and the projection to its end.

    The current run bills ``elapsed_s`` x ``devices``; earlier runs bring their own device-hours
    (``prior_device_hours``, each billed at the world size it ran on), so a resume on another number of devices never
    re-bills them. The projection uses the current run's rate only: its ``steps_done - prior_steps`` steps (or
    ``tokens - prior_tokens`` tokens) in ``elapsed_s`` seconds, the rest billed at ``devices``.

    Args:
        elapsed_s: wall-clock seconds of the current run (since its start or resume).
        devices: devices of the current run (world size).
        price_per_device_hour: dollars per device-hour, or ``None``.
        tokens: tokens trained on so far, all runs and devices together; ``None`` if unknown (no per-token figures, no
            projection to ``tokens_target``).
        steps_done, steps_total: optimizer steps done so far (all runs) and planned (``trainer.max_steps``).
        tokens_target: alternatively, a token budget; used when given.
        idle_fraction: share of wall time the devices were idle or stalled (from StepTimer / GPUMonitor).
        samples: samples trained on so far, all runs and devices together, or ``None``.
        prior_device_hours: device-hours billed by earlier runs (restored from a checkpoint).
        prior_steps: optimizer steps done before the current run started.
        prior_tokens: tokens (all devices) trained on before the current run started.

    Raises:
        ValueError: negative time or prior figures, fewer than one device, or more prior steps than steps done.
    """
    if elapsed_s < 0 or devices < 1 or prior_device_hours < 0 or not 0 <= prior_steps <= max(steps_done, 0):
        raise ValueError(
            f"elapsed_s={elapsed_s} and prior_device_hours={prior_device_hours} must be >= 0, devices={devices} >= 1, "
            f"and 0 <= prior_steps={prior_steps} <= steps_done={steps_done}"
        )
    hours = prior_device_hours + elapsed_s / 3600 * devices
    dollars = None if price_per_device_hour is None else hours * price_per_device_hour
    per_1b = None if dollars is None or not tokens else dollars / tokens * 1e9
    per_1m_samples = None if dollars is None or not samples else dollars / samples * 1e6
    left: float | None = None
    if elapsed_s > 0:  # no rate is measured before the current run has taken time
        if tokens_target is not None:  # the user's target: no projection at all rather than one to another end
            run_tokens = None if tokens is None else tokens - prior_tokens
            left = max(0.0, elapsed_s * (tokens_target - tokens) / run_tokens) if tokens and run_tokens else None
        elif steps_total is not None and steps_total > 0 and steps_done > prior_steps:
            left = max(0.0, elapsed_s * (steps_total - steps_done) / (steps_done - prior_steps))
    projected = (
        None
        if dollars is None or left is None or price_per_device_hour is None
        else dollars + left / 3600 * devices * price_per_device_hour
    )
    lost = None if dollars is None or idle_fraction is None else dollars * idle_fraction
    return CostReport(hours, dollars, per_1b, per_1m_samples, left, projected, idle_fraction, lost)
