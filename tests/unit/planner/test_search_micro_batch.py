"""search_plans refuses micro-batches it cannot search instead of enumerating nothing."""

from __future__ import annotations

from functools import partial

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPTConfig
from lightning_trainopt.planner import (
    OPTIMIZER_STATES,
    ActivationPolicy,
    PlanInputs,
    SearchSpace,
    StrategyLayout,
    estimate_plan,
    search_plans,
)
from lightning_trainopt.planner.search import simplicity

MODEL = GPTConfig(name="m", vocab_size=256, n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, max_seq_len=64)
BASE = PlanInputs(MODEL, micro_batch=2, accumulate=3, seq_len=64, devices=2)  # 6 sequences per device per step
ESTIMATE = partial(estimate_plan, device_memory_bytes=80 * 2**30, peak_flops=1e12, price_per_device_hour=1.0)


def _space(micro_batches: tuple) -> SearchSpace:
    return SearchSpace(
        precisions={"fp32": "32-true"},
        strategies={"zero2": StrategyLayout("zero2", "deepspeed", 2)},
        activations={"none": ActivationPolicy()},
        optimizers={"adamw": OPTIMIZER_STATES["adamw"]},
        micro_batches=micro_batches,
    )


@pytest.mark.parametrize("micro_batches", [(), (0,), (-2,), (1.5,), (True,)])
def test_micro_batches_that_are_not_positive_integers_are_refused(micro_batches):
    with pytest.raises(ConfigError, match="plan.search_space.micro_batch"):
        search_plans(BASE, _space(micro_batches), ESTIMATE)


def test_micro_batches_that_divide_nothing_name_the_global_batch():
    with pytest.raises(ConfigError, match=r"global batch of 12 sequences.*divisors of 6: \[1, 2, 3, 6\]"):
        search_plans(BASE, _space((4, 5)), ESTIMATE)


def test_only_the_dividing_micro_batches_are_enumerated():
    ranked, n = search_plans(BASE, _space((1, 3, 4)), ESTIMATE)
    assert n == 2
    assert {(c.estimate.inputs.micro_batch, c.estimate.inputs.accumulate) for c in ranked} == {(1, 6), (3, 2)}


def test_no_strategy_ranks_simplest():
    names = ["zero3_offload", "fsdp", "ddp", "none", "zero1"]
    assert sorted(names, key=simplicity) == ["none", "ddp", "zero1", "fsdp", "zero3_offload"]
