"""Step time, tokens/s and dollars from FLOPs and an MFU assumption, or from a measured run."""

from __future__ import annotations

import pytest

from lightning_trainopt.core.estimate import estimate_speed
from lightning_trainopt.exceptions import ConfigError


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
        ({"mfu": 1.5}, "plan.mfu"),
        ({"mfu": 0}, "plan.mfu"),
        ({"target_tokens": 0}, "plan.target_tokens"),
        ({"measured_tokens_per_sec_per_device": -1.0}, "plan.measured"),
    ],
)
def test_bad_inputs_raise(kwargs, key):
    args = {"mfu": 0.4, "target_tokens": 1e9, **kwargs}
    with pytest.raises(ConfigError, match=key):
        estimate_speed(1e9, 1, 1, 1e12, price_per_device_hour=1.0, **args)
