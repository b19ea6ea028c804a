from __future__ import annotations

import math

import pytest

from lightning_trainopt.core.schedules import check_warmup_cosine, warmup_cosine_factor
from lightning_trainopt.exceptions import ConfigError


def test_warmup_is_linear_then_cosine_to_floor():
    w, total, floor = 10, 110, 0.1
    assert warmup_cosine_factor(0, w, total, floor) == pytest.approx(0.1)
    assert warmup_cosine_factor(4, w, total, floor) == pytest.approx(0.5)
    assert warmup_cosine_factor(9, w, total, floor) == pytest.approx(1.0)
    assert warmup_cosine_factor(10, w, total, floor) == pytest.approx(1.0)
    mid = warmup_cosine_factor(60, w, total, floor)
    assert mid == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine_factor(110, w, total, floor) == pytest.approx(floor)
    assert warmup_cosine_factor(500, w, total, floor) == pytest.approx(floor)


def test_no_warmup_starts_at_peak():
    assert warmup_cosine_factor(0, 0, 100) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("warmup", "total", "ratio", "key"),
    [
        (10, 10, 0.0, "scheduler.warmup_steps"),
        (-1, 10, 0.0, "scheduler.warmup_steps"),
        (1, 0, 0.0, "scheduler.total_steps"),
        (1, 10, 1.5, "scheduler.min_lr_ratio"),
        (1, 10, "a", "scheduler.min_lr_ratio"),
        (1, 10, float("nan"), "scheduler.min_lr_ratio"),
        (True, 10, 0.0, "scheduler.warmup_steps"),
        (2.0, 10, 0.0, "scheduler.warmup_steps"),
        (1, 10.0, 0.0, "scheduler.total_steps"),
        (1, None, "a", "scheduler.min_lr_ratio"),
    ],
)
def test_bad_schedules_are_refused(warmup, total, ratio, key):
    with pytest.raises(ConfigError) as err:
        check_warmup_cosine(warmup, total, ratio)
    assert err.value.key == key


def test_total_steps_may_be_unknown_yet():
    # The callback checks warmup and ratio in __init__ and the total once the Trainer knows it.
    assert check_warmup_cosine(100, None, 0.1) is None
    with pytest.raises(ConfigError, match="warmup must be shorter than the 100 optimizer steps"):
        check_warmup_cosine(100, 100, 0.1)
