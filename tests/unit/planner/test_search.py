"""plan.search: enumeration holds the global batch, drops what does not fit or is not allowed, ranks by dollars."""

from __future__ import annotations

from functools import partial

import pytest

from lightning_trainopt.metrics.hardware import hardware_spec
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
from lightning_trainopt.planner.offload_time import Bandwidths
from lightning_trainopt.planner.search import best_per_configuration

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


def test_configurations_at_the_cheapest_price_are_ranked_by_margin():
    ranked, _ = _run(80)
    rows = best_per_configuration(ranked)
    win = rows[0]
    # bf16's peak beats fp32's, and checkpointing's recomputation costs FLOPs.
    assert (win.choices["precision"], win.choices["activations"]) == ("bf16", "none")
    price = win.estimate.speed.usd_per_1b_tokens
    tied = [r for r in rows if r.estimate.speed.usd_per_1b_tokens == pytest.approx(price, rel=1e-12)]
    # ddp, zero2 and zero3 with either optimizer cost the same here: the one with the most memory to spare leads.
    assert {r.choices["strategy"] for r in tied} == {"ddp", "zero2", "zero3"}
    margins = [r.estimate.margin_bytes for r in tied]
    assert margins == sorted(margins, reverse=True)
    assert len(set(margins)) == len(margins)
    assert win.choices["strategy"] == "zero3"  # the most sharded and so the largest margin
    assert f"cheapest, most margin of {len(tied)} at this price" in win.reason
    assert all(r.reason.endswith("+0% $ (less margin)") for r in tied[1:])
    for row in tied:
        # Within a configuration the largest micro-batch at that price is its row (fewest accumulation steps).
        same = [c for c in ranked if c.choices == row.choices and c.estimate.speed.usd_per_1b_tokens == price]
        assert row.estimate.inputs.micro_batch == max(c.estimate.inputs.micro_batch for c in same)


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


# The published LLaMA-13B shape (conf/model/llama_13b.yaml).
LLAMA_13B = GPTConfig(
    name="llama_13b",
    vocab_size=32000,
    n_layers=40,
    d_model=5120,
    n_heads=40,
    ffn_hidden=13824,
    max_seq_len=4096,
    tie_embeddings=False,
)


def test_13b_on_8_a100_40gb_pays_for_activation_offload_and_ranks_it_below_keeping_activations():
    hw = hardware_spec("a100_40gb")
    rates = Bandwidths(hw.pcie_bytes_per_s, hw.memory_bytes_per_s, hw.nvme_bytes_per_s, hw.cpu_adam_params_per_s)
    space = SearchSpace(
        precisions={"bf16": "bf16-mixed"},
        strategies={"fsdp": StrategyLayout("fsdp", "fsdp"), "zero3": StrategyLayout("zero3", "deepspeed", 3)},
        activations={"none": ActivationPolicy(), "offload": ActivationPolicy(offload=True, name="offload")},
        optimizers={"adamw": OPTIMIZER_STATES["adamw"], "adamw8bit": OPTIMIZER_STATES["adamw8bit"]},
        micro_batches=(1, 4),
    )
    base = PlanInputs(LLAMA_13B, micro_batch=1, accumulate=16, seq_len=2048, devices=8)
    est = partial(
        estimate_plan,
        device_memory_bytes=hw.memory_bytes,
        peak_flops=hw.peak("bf16"),
        price_per_device_hour=hw.price_per_device_hour,
        headroom_fraction=0.05,
        host_memory_bytes=hw.host_memory_bytes,
        bandwidths=rates,
    )
    ranked, _ = search_plans(base, space, est)
    rows = best_per_configuration(ranked)
    offloaded = [r for r in rows if r.choices["activations"] == "offload"]
    assert offloaded
    for r in offloaded:
        e = r.estimate
        # Saved activations out in the forward and back in the backward of each micro-batch, at 32 GB/s.
        charged = 2 * e.memory.bytes("activations", "cpu") * e.inputs.accumulate / 32e9
        assert e.speed.overhead.serial == {"activation offload": pytest.approx(charged)}
        assert charged > 0
        assert e.speed.step_time_s == pytest.approx(e.speed.compute_s + charged)
    # The same FLOPs without the copies are cheaper: where keeping the activations fits, it ranks first.
    kept = [r for r in rows if r.choices["activations"] == "none"]
    assert kept
    assert rows[0].choices["activations"] == "none"
    for r in offloaded:
        twin = [k for k in kept if k.choices == {**r.choices, "activations": "none"}]
        if twin:
            assert rows.index(twin[0]) < rows.index(r)
