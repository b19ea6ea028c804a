"""Step time, tokens/s and dollars from FLOPs, an HFU assumption and the offload overhead, or from a measured run."""

from __future__ import annotations

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner import estimate_speed
from lightning_trainopt.planner.offload_time import StepOverhead


def test_flops_model_and_dollars():
    # 1e9 FLOP/token at 50% of 100 TFLOP/s -> 5e4 tok/s per device; 4 devices at $2/h.
    s = estimate_speed(1e9, 1000, 4, 100e12, 0.5, 2.0, target_tokens=2e9)
    assert s.tokens_per_sec_per_device == pytest.approx(5e4)
    assert s.step_time_s == pytest.approx(1000 / 5e4)
    hours = 2e9 / (4 * 5e4) / 3600
    assert s.hours_to_target == pytest.approx(hours)
    assert s.usd_to_target == pytest.approx(hours * 2.0 * 4)
    assert s.usd_per_1b_tokens == pytest.approx(s.usd_to_target / 2)


def test_measured_tokens_per_sec_wins():
    s = estimate_speed(1e9, 1000, 2, 100e12, 0.5, 3.6, 1e9, measured_tokens_per_sec_per_device=1000.0)
    assert s.tokens_per_sec_per_device == 1000.0
    assert "measured" in s.source
    assert s.usd_per_1b_tokens == pytest.approx(3.6 * 2 * 1e9 / 2000 / 3600)


def test_unknown_peak_or_price_gives_none_not_a_guess():
    s = estimate_speed(1e9, 1000, 1, None, 0.4, 2.0, 1e9)
    assert s.tokens_per_sec_per_device is None
    assert s.usd_per_1b_tokens is None
    s = estimate_speed(1e9, 1000, 1, 1e12, 0.4, None, 1e9)
    assert s.tokens_per_sec_per_device == pytest.approx(400)
    assert s.usd_per_1b_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"hfu": 1.5}, "plan.hfu"),
        ({"hfu": 0}, "plan.hfu"),
        ({"target_tokens": 0}, "plan.target_tokens"),
        ({"measured_tokens_per_sec_per_device": -1.0}, "plan.measured"),
    ],
)
def test_bad_inputs_raise(kwargs, key):
    args = {"hfu": 0.4, "target_tokens": 1e9, **kwargs}
    with pytest.raises(ConfigError, match=key):
        estimate_speed(1e9, 1, 1, 1e12, price_per_device_hour=1.0, **args)


@pytest.mark.parametrize(
    ("overlapped", "serial", "step"),
    [
        # Copies beside compute shorter than compute hide; waits add: max(2, 1.5) + 0.5 + 0.25.
        ({"PCIe device -> host": 1.5}, {"CPU Adam": 0.5, "activation offload": 0.25}, 2.75),
        # Each direction has its own copy engine: the longer one counts, and it is longer than compute here.
        ({"PCIe device -> host": 3.0, "PCIe host -> device": 2.5}, {"CPU Adam": 0.5}, 3.5),
        ({}, {}, 2.0),
    ],
)
def test_overhead_adds_to_the_compute_time(overlapped, serial, step):
    # 1e9 FLOP/token, 1000 tokens per step, 50% of 1 TFLOP/s: 2 s of compute per step.
    overhead = StepOverhead(overlapped, serial)
    s = estimate_speed(1e9, 1000, 4, 1e12, 0.5, 2.0, 1e9, overhead=overhead)
    assert s.compute_s == pytest.approx(2.0)
    assert s.step_time_s == pytest.approx(step)
    assert s.tokens_per_sec_per_device == pytest.approx(1000 / step)
    assert s.usd_per_1b_tokens == pytest.approx(2.0 * 4 * 1e9 / (4 * 1000 / step) / 3600)
    assert s.hfu == 0.5
    # The MFU a plan implies: model FLOPs (here 0.75e9 of the 1e9 executed) x tokens/s / peak.
    assert s.mfu(0.75e9) == pytest.approx(0.75e9 * (1000 / step) / 1e12)


def test_a_measured_speed_is_not_charged_again():
    overhead = StepOverhead({}, {"CPU Adam": 5.0})
    s = estimate_speed(1e9, 1000, 1, 1e12, 0.5, 2.0, 1e9, 500.0, overhead=overhead)
    assert s.step_time_s == pytest.approx(2.0)
    assert (s.overhead, s.compute_s, s.hfu) == (None, None, None)
