"""plan.search: enumeration holds the global batch, drops what does not fit or is not allowed, ranks by dollars."""

from __future__ import annotations

from functools import partial

from lightning_trainopt.core.estimate import (
    OPTIMIZER_STATES,
    ActivationPolicy,
    PlanInputs,
    SearchSpace,
    StrategyLayout,
    estimate_plan,
    search_plans,
)
from lightning_trainopt.core.estimate.search import best_per_configuration
from lightning_trainopt.models import GPTConfig

MODEL = GPTConfig(name="m", vocab_size=32000, n_layers=8, d_model=1024, n_heads=8, ffn_hidden=2816, max_seq_len=2048)
SPACE = SearchSpace(
    precisions={"fp32": "32-true", "bf16": "bf16-mixed"},
    strategies={
        "ddp": StrategyLayout("ddp", "ddp"),
        "zero2": StrategyLayout("zero2", "deepspeed", 2),
        "zero3": StrategyLayout("zero3", "deepspeed", 3),
    },
    activations={"none": ActivationPolicy(), "checkpoint": ActivationPolicy(1, name="checkpoint")},
    optimizers={"adamw": OPTIMIZER_STATES["adamw"], "adamw8bit": OPTIMIZER_STATES["adamw8bit"]},
    micro_batches=(1, 2, 4, 8),
)


def _run(memory_gib: float, allowed=None):
    base = PlanInputs(MODEL, micro_batch=2, accumulate=4, seq_len=2048, devices=4)
    est = partial(
        estimate_plan, device_memory_bytes=int(memory_gib * 2**30), peak_flops=312e12, price_per_device_hour=4.8
    )
    return search_plans(base, SPACE, est, allowed=allowed)


def test_everything_ranked_fits_and_keeps_global_batch():
    ranked, n = _run(4)
    assert 0 < len(ranked) < n
    for c in ranked:
        i = c.estimate.inputs
        assert c.estimate.fits
        assert i.micro_batch * i.accumulate * i.world_size == 2 * 4 * 4
    costs = [c.estimate.speed.usd_per_1b_tokens for c in ranked]
    assert costs == sorted(costs)


def test_bf16_without_checkpointing_wins_when_it_fits():
    ranked, _ = _run(80)
    win = ranked[0]
    # bf16 peak beats fp32, and checkpointing's recomputation costs FLOPs; ddp is simplest among equals.
    assert win.choices == {"precision": "bf16", "strategy": "ddp", "activations": "none", "optimizer": "adamw"}
    assert win.estimate.inputs.micro_batch == 8  # largest micro-batch among equals
    assert "cheapest" in win.reason


def test_nothing_fits_on_a_tiny_device():
    ranked, n = _run(0.5)
    assert ranked == []
    assert n > 0


def test_8bit_optimizers_are_enumerated_with_zero_and_the_allowed_rule_decides():
    _, n_all = _run(80)
    ranked, _ = _run(80)
    assert any(c.choices["optimizer"] == "adamw8bit" and c.choices["strategy"] == "zero2" for c in ranked)

    def no_8bit_zero3(choices, inputs):
        return not (choices["optimizer"] == "adamw8bit" and choices["strategy"] == "zero3")

    ranked_rule, n_rule = _run(80, allowed=no_8bit_zero3)
    assert n_rule < n_all  # refused candidates are not even enumerated
    assert not any(c.choices["optimizer"] == "adamw8bit" and c.choices["strategy"] == "zero3" for c in ranked_rule)


def test_adam_path_for_sets_each_candidates_step_path():
    base = PlanInputs(MODEL, micro_batch=2, accumulate=4, seq_len=2048, devices=4)
    est = partial(estimate_plan, device_memory_bytes=None, peak_flops=312e12, price_per_device_hour=4.8)
    ranked, _ = search_plans(
        base, SPACE, est, adam_path_for=lambda i: "foreach" if i.layout.kind == "deepspeed" else "fused"
    )
    for c in ranked:
        assert c.estimate.inputs.adam_path == ("foreach" if c.estimate.inputs.layout.kind == "deepspeed" else "fused")


def test_best_per_configuration_keeps_one_row_per_configuration_at_its_best_micro_batch():
    ranked, _ = _run(80)
    rows = best_per_configuration(ranked)
    key = lambda c: tuple(sorted(c.choices.items()))  # noqa: E731
    assert len(rows) < len(ranked)  # the full ranking has each configuration at several micro-batches
    assert [key(c) for c in rows] == list(dict.fromkeys(key(c) for c in ranked))  # each once, in rank order
    for row in rows:
        variants = [c for c in ranked if key(c) == key(row)]
        assert row is variants[0]  # its best-ranked micro-batch
        assert len({(c.estimate.inputs.micro_batch, c.estimate.inputs.accumulate) for c in variants}) > 1
    assert rows[0] is ranked[0]
