"""Step time, tokens/s and dollars: from FLOPs and a utilisation assumption, or from a measured run."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_trainopt.exceptions import ConfigError

__all__ = ["SpeedEstimate", "estimate_speed"]


@dataclass(frozen=True)
class SpeedEstimate:
    """Predicted speed and cost of one configuration.

    Args:
        tokens_per_sec_per_device: tokens one device processes per second (``None``: unknown peak, no measurement).
        step_time_s: seconds per optimizer step.
        usd_per_1b_tokens: dollars per 1e9 tokens for the whole job (all devices); ``None`` without a price.
        hours_to_target: wall-clock hours to train ``target_tokens``.
        usd_to_target: dollars to train ``target_tokens`` (hardware cost x time).
        source: where the speed comes from, in words.
    """

    tokens_per_sec_per_device: float | None
    step_time_s: float | None
    usd_per_1b_tokens: float | None
    hours_to_target: float | None
    usd_to_target: float | None
    source: str


def estimate_speed(
    train_flops_per_token: float,
    tokens_per_step_per_device: int,
    n_devices: int,
    peak_flops: float | None,
    mfu: float,
    price_per_device_hour: float | None,
    target_tokens: float,
    measured_tokens_per_sec_per_device: float | None = None,
) -> SpeedEstimate:
    """Predict speed and cost.

    Time per token is ``hardware FLOPs per token / (peak x mfu)``: ``mfu`` is the fraction of the dense peak the
    run sustains on the FLOPs it really executes (recomputation included in ``train_flops_per_token`` when the
    caller counts it). A measured tokens/s (from a short run's metrics.json) replaces the assumption.

    Args:
        train_flops_per_token: FLOPs the hardware executes per token (forward + backward [+ recomputation]).
        tokens_per_step_per_device: micro-batch x sequence length x accumulation.
        n_devices: devices in the job.
        peak_flops: dense peak FLOP/s of one device in the compute dtype, ``None`` when unknown.
        mfu: assumed utilisation of that peak, in (0, 1].
        price_per_device_hour: dollars per device-hour, ``None`` when not set.
        target_tokens: tokens to train, for time and dollars to target.
        measured_tokens_per_sec_per_device: a measured figure, which wins over the FLOPs model.

    Raises:
        ConfigError: ``mfu`` outside (0, 1], non-positive target.
    """
    if not 0 < mfu <= 1:
        raise ConfigError("plan.mfu", mfu, "use a fraction of the peak in (0, 1], e.g. 0.4.")
    if not target_tokens > 0:
        raise ConfigError("plan.target_tokens", target_tokens, "use a positive token count, e.g. 1e9.")
    if measured_tokens_per_sec_per_device is not None:
        if not measured_tokens_per_sec_per_device > 0:
            raise ConfigError(
                "plan.measured", measured_tokens_per_sec_per_device, "the metrics.json gives no positive tokens/s."
            )
        tps = float(measured_tokens_per_sec_per_device)
        source = "measured tokens/s from metrics.json"
    elif peak_flops:
        tps = peak_flops * mfu / train_flops_per_token
        source = f"{train_flops_per_token:.3g} FLOP/token at {mfu:.0%} of {peak_flops / 1e12:g} TFLOP/s peak"
    else:
        return SpeedEstimate(None, None, None, None, None, "no peak FLOP/s for this hardware and no measured run")
    step = tokens_per_step_per_device / tps
    hours = target_tokens / (tps * n_devices) / 3600
    if price_per_device_hour is None:
        return SpeedEstimate(tps, step, None, hours, None, source + "; no price set")
    usd_per_1b = price_per_device_hour * n_devices * (1e9 / (tps * n_devices)) / 3600
    return SpeedEstimate(tps, step, usd_per_1b, hours, hours * price_per_device_hour * n_devices, source)
