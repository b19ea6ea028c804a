from __future__ import annotations

import math

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.optim.schedules import (
    DEFAULT_WARMUP_RATIO,
    check_warmup_cosine,
    resolve_warmup_steps,
    warmup_cosine_factor,
)


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


@pytest.mark.parametrize("total", [1, 2, 3, 5, 10, 29, 30, 300, 10_000])
@pytest.mark.parametrize("ratio", [None, 0.0, 0.034, 0.1, 0.5, 0.99])
def test_a_warmup_ratio_fits_every_run_length(total, ratio):
    check_warmup_cosine(None, total, 0.1, warmup_ratio=ratio)
    warmup = resolve_warmup_steps(None, ratio, total)
    assert 0 <= warmup < total


@pytest.mark.parametrize(
    ("warmup_steps", "ratio", "total", "expected"),
    [
        (None, None, 300, 10),  # the Quickstart's figure is kept
        (None, None, 1, 0),
        (None, None, 29, 0),
        (None, None, 30, 1),
        (None, 0.1, 5, 0),
        (None, 0.29, 100, 29),  # as written, not 28.999... as a float product
        (None, 0.5, 3, 1),
        (7, None, 300, 7),  # explicit steps win over the default ratio
        (0, None, 1, 0),
    ],
)
def test_resolved_warmup(warmup_steps, ratio, total, expected):
    assert resolve_warmup_steps(warmup_steps, ratio, total) == expected
    assert DEFAULT_WARMUP_RATIO == 0.034


@pytest.mark.parametrize("ratio", [1.0, 1, -0.1, 2.5, "0.1", float("nan"), True])
def test_bad_warmup_ratio_is_refused(ratio):
    with pytest.raises(ConfigError) as err:
        check_warmup_cosine(None, 100, 0.1, warmup_ratio=ratio)
    assert err.value.key == "scheduler.warmup_ratio"
    assert "[0, 1)" in str(err.value)


def test_both_warmups_are_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        check_warmup_cosine(5, 100, 0.1, prefix="callbacks.warmup_cosine_lr", warmup_ratio=0.1)
    assert err.value.key == "callbacks.warmup_cosine_lr.warmup_ratio"
    assert "callbacks.warmup_cosine_lr.warmup_steps=5" in str(err.value)


def test_explicit_warmup_steps_longer_than_the_run_are_still_refused():
    with pytest.raises(ConfigError) as err:
        check_warmup_cosine(10, 10, 0.1)
    assert err.value.key == "scheduler.warmup_steps"
    assert "scheduler.warmup_ratio" in str(err.value)
