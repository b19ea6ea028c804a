"""Step time, tokens/s and dollars: from FLOPs, a utilisation assumption and the offload overhead, or from a
measured run."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.offload_time import StepOverhead

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
        compute_s: seconds per step of the FLOPs at ``hfu`` of the peak (``None``: measured or unknown).
        overhead: seconds per step of offload copies, CPU Adam, NVMe swaps and int8 compression (``None``: none
            charged, or the speed is measured).
        hfu: the hardware FLOPs utilisation assumed for ``compute_s`` (``None`` when the speed is measured).
        peak_flops: the dense peak FLOP/s used (``None`` when unknown): the compute dtype's (bf16 under FP8), which
            the implied MFU is measured against.
        fp8_flops_share: share of the model FLOPs in FP8-converted layers (0 without FP8).
        fp8_peak_flops: the dense FP8 peak those FLOPs ran at (``None``: no FP8 peak, they ran at ``peak_flops``).
    """

    tokens_per_sec_per_device: float | None
    step_time_s: float | None
    usd_per_1b_tokens: float | None
    hours_to_target: float | None
    usd_to_target: float | None
    source: str
    compute_s: float | None = None
    overhead: StepOverhead | None = None
    hfu: float | None = None
    peak_flops: float | None = None
    fp8_flops_share: float = 0.0
    fp8_peak_flops: float | None = None

    def mfu(self, model_flops_per_token: float) -> float | None:
        """Model FLOPs utilisation the prediction implies: model FLOPs x tokens/s / peak (``None`` if unknown)."""
        if not self.tokens_per_sec_per_device or not self.peak_flops:
            return None
        return model_flops_per_token * self.tokens_per_sec_per_device / self.peak_flops


def estimate_speed(
    train_flops_per_token: float,
    tokens_per_step_per_device: float,
    n_devices: int,
    peak_flops: float | None,
    hfu: float,
    price_per_device_hour: float | None,
    target_tokens: float,
    measured_tokens_per_sec_per_device: float | None = None,
    overhead: StepOverhead | None = None,
    fp8_flops_share: float = 0.0,
    fp8_peak_flops: float | None = None,
    emulated: bool = False,
) -> SpeedEstimate:
    """Predict speed and cost.

    Compute time per token is ``executed FLOPs per token / (peak x hfu)``: ``hfu`` is the fraction of the dense peak
    the run sustains on the FLOPs it really executes (recomputation included in ``train_flops_per_token`` when the
    caller counts it), a hardware FLOPs utilisation; the model FLOPs utilisation it implies is
    :meth:`SpeedEstimate.mfu`. The step then takes ``overhead.step_time(compute)``: offload copies that run beside
    compute hide behind it, the rest adds. A measured tokens/s (from a short run's metrics.json) replaces both.

    Args:
        train_flops_per_token: FLOPs the hardware executes per token (forward + backward [+ recomputation]).
        tokens_per_step_per_device: micro-batch x sequence length x accumulation (/ TP size: a TP group shares
            its replica's tokens).
        n_devices: devices in the job.
        peak_flops: dense peak FLOP/s of one device in the compute dtype, ``None`` when unknown.
        hfu: assumed utilisation of that peak on the executed FLOPs, in (0, 1].
        price_per_device_hour: dollars per device-hour, ``None`` when not set.
        target_tokens: tokens to train, for time and dollars to target.
        measured_tokens_per_sec_per_device: a measured figure, which wins over the FLOPs model.
        overhead: per-step seconds of offload and compression (``offload_time.estimate_step_overhead``).
        fp8_flops_share: share of the FLOPs in FP8-converted layers: they run at ``fp8_peak_flops`` x ``hfu``, the
            rest at ``peak_flops`` x ``hfu``.
        fp8_peak_flops: dense FP8 peak; ``None`` (a CPU emulating FP8, a GPU without FP8 tensor cores): every FLOP at
            ``peak_flops``, no speed-up is invented.
        emulated: FP8 is emulated (planned for a CPU), for the source text.

    Raises:
        ConfigError: ``hfu`` outside (0, 1], non-positive target.
    """
    if not 0 < hfu <= 1:
        raise ConfigError("plan.hfu", hfu, "use a fraction of the peak in (0, 1], e.g. 0.4.")
    if not target_tokens > 0:
        raise ConfigError("plan.target_tokens", target_tokens, "use a positive token count, e.g. 1e9.")
    if measured_tokens_per_sec_per_device is not None:
        if not measured_tokens_per_sec_per_device > 0:
            raise ConfigError(
                "plan.measured", measured_tokens_per_sec_per_device, "the metrics.json gives no positive tokens/s."
            )
        tps = float(measured_tokens_per_sec_per_device)
        step = tokens_per_step_per_device / tps
        source = "measured tokens/s from metrics.json"
        compute, overhead, hfu_used = None, None, None
    elif peak_flops:
        share = fp8_flops_share if fp8_peak_flops else 0.0
        seconds_per_flop = (1 - share) / peak_flops + (share / fp8_peak_flops if fp8_peak_flops else 0.0)
        compute = tokens_per_step_per_device * train_flops_per_token * seconds_per_flop / hfu
        step = overhead.step_time(compute) if overhead is not None else compute
        tps = tokens_per_step_per_device / step
        source = f"{train_flops_per_token:.3g} FLOP/token at {hfu:.0%} (HFU) of {peak_flops / 1e12:g} TFLOP/s peak"
        if fp8_flops_share and fp8_peak_flops:
            source += f", {fp8_flops_share:.0%} of them at the {fp8_peak_flops / 1e12:g} TFLOP/s FP8 peak"
        elif fp8_flops_share:
            why = "emulated in fp32 on a CPU" if emulated else "no FP8 peak for this hardware"
            source += f"; FP8 layers ({fp8_flops_share:.0%} of the FLOPs) at that peak too: {why}, no FP8 speed-up"
        if overhead is not None and step > compute:
            source += f"; + {step - compute:.3g} s/step offload and compression"
        hfu_used = hfu
    else:
        return SpeedEstimate(None, None, None, None, None, "no peak FLOP/s for this hardware and no measured run")
    hours = target_tokens / (tps * n_devices) / 3600
    usd_per_1b = usd_to_target = None
    if price_per_device_hour is None:
        source += "; no price set"
    else:
        usd_per_1b = price_per_device_hour * n_devices * (1e9 / (tps * n_devices)) / 3600
        usd_to_target = hours * price_per_device_hour * n_devices
    return SpeedEstimate(
        tps,
        step,
        usd_per_1b,
        hours,
        usd_to_target,
        source,
        compute,
        overhead,
        hfu_used,
        peak_flops,
        fp8_flops_share,
        fp8_peak_flops if fp8_flops_share else None,
    )
