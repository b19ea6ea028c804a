from __future__ import annotations

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.techniques.micro_batch import divisors, fit_linear_bytes, plan_micro_batch


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
