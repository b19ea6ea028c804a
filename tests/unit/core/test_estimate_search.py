"""plan.search: enumeration holds the global batch, drops what does not fit, ranks by dollars then simplicity."""

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


def _run(memory_gib: float):
    base = PlanInputs(MODEL, micro_batch=2, accumulate=4, seq_len=2048, devices=4)
    est = partial(
        estimate_plan, device_memory_bytes=int(memory_gib * 2**30), peak_flops=312e12, price_per_device_hour=4.8
    )
    return search_plans(base, SPACE, est)


def test_everything_ranked_fits_and_keeps_global_batch():
    ranked, n = _run(4)
    assert 0 < len(ranked) < n
    for c in ranked:
        i = c.estimate.inputs
        assert c.estimate.fits
        assert i.micro_batch * i.accumulate * i.world_size == 2 * 4 * 4
        assert not (i.optimizer.bits != 32 and i.layout.kind == "deepspeed")  # 8-bit x ZeRO refused
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
