from __future__ import annotations

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.optim.micro_batch import (
    divisors,
    fit_linear_bytes,
    nearby_global_batches,
    plan_micro_batch,
)


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert divisors(49) == [1, 7, 49]


def test_fit_linear() -> None:
    assert fit_linear_bytes(150, 250) == (100, 50)


def test_plan_keeps_global_batch() -> None:
    plan = plan_micro_batch(global_batch=64, world_size=2, per_sample_bytes=100, fixed_bytes=1000, budget_bytes=1850)
    # per device 32; 1000 + 8 * 100 = 1800 fits, 16 would need 2600.
    assert (plan.micro_batch, plan.accumulate) == (8, 4)
    assert plan.micro_batch * plan.accumulate * plan.world_size == 64
    assert plan.predicted_bytes == 1800


def test_plan_only_divisors_and_max() -> None:
    plan = plan_micro_batch(global_batch=12, world_size=1, per_sample_bytes=1, fixed_bytes=0, budget_bytes=5)
    assert plan.micro_batch == 4  # 5 fits but does not divide 12
    plan = plan_micro_batch(12, 1, 1, 0, 10**9, max_micro_batch=5)
    assert (plan.micro_batch, plan.accumulate) == (4, 3)


def test_plan_refuses_when_nothing_fits() -> None:
    with pytest.raises(ConfigError, match="budget_bytes") as err:
        plan_micro_batch(8, 1, per_sample_bytes=2**30, fixed_bytes=2**30, budget_bytes=2**30)
    assert "activations=checkpoint" in str(err.value)
    with pytest.raises(ConfigError, match="world size"):
        plan_micro_batch(6, 4, 1, 0, 100)


def test_prime_global_batch_warns_with_better_sizes() -> None:
    # 11 samples fit. 12 = 6 x 2 uses the budget well; 13 is prime and falls back to micro-batch 1.
    good = plan_micro_batch(12, 1, per_sample_bytes=100, fixed_bytes=0, budget_bytes=1100)
    assert (good.micro_batch, good.largest_fitting) == (6, 11)
    assert good.divisor_advice() is None
    bad = plan_micro_batch(13, 1, per_sample_bytes=100, fixed_bytes=0, budget_bytes=1100)
    assert (bad.micro_batch, bad.accumulate, bad.largest_fitting) == (1, 13, 11)
    advice = bad.divisor_advice()
    assert advice is not None
    assert "up to 11" in advice
    assert "[12, 14]" in advice
    assert "data.batch_size" in advice


def test_nearby_global_batches_respect_the_world_size() -> None:
    # 2 ranks, 13 per device: candidates are even global batches whose half has a divisor in 6..11.
    assert nearby_global_batches(26, 2, 11) == [24, 28]
    assert all(g % 2 == 0 for g in nearby_global_batches(26, 2, 11, count=4))
    # The largest that fits caps the advice: with room for the whole batch no warning is due.
    assert plan_micro_batch(13, 1, 1, 0, 10**9).divisor_advice() is None
