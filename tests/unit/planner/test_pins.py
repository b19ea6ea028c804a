"""Pins for planner arithmetic that earlier tests let through.

Each test kills a single realistic mutation that the other unit tests survived: the plan's step time without the
accumulation, the fit verdicts' boundaries, the search dropping candidates whose fit is unknown, the peak without
the in-step temporaries, and every factor the other tests only ever set to 1 (accumulation, recompute fraction,
ZeRO stage, world size). Every expected value is worked out by hand in the comments.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import (
    OPTIMIZER_STATES,
    ActivationPolicy,
    Candidate,
    MemoryEstimate,
    PlanEstimate,
    PlanInputs,
    SearchSpace,
    SpeedEstimate,
    StrategyLayout,
    Term,
    estimate_model_states,
    estimate_plan,
    estimate_speed,
    estimate_transformer_activations,
    gpt_param_groups,
    rank_candidates,
    search_plans,
)

ADAMW = OPTIMIZER_STATES["adamw"]

# One block, d=8, 2 heads of 4, FFN 16, vocabulary 100. Per block and token the matmuls hold
# q 8x8 + k, v 2 x 8x8 + o 8x8 + gate, up, down 3 x 8x16 = 640 weights. A micro-batch of 2 sequences of 4 tokens
# (8 tokens): blocks 2 x 640 x 8 = 10,240, attention 4 x B 2 x H 2 x T 4 x T 4 x hd 4 = 1,024, lm_head
# 2 x 8 x 100 x 8 = 12,800: forward 24,064, training 3 x 24,064 = 72,192 FLOPs = 9,024 per token.
ONE_BLOCK = GPTConfig(vocab_size=100, n_layers=1, d_model=8, n_heads=2, ffn_hidden=16, max_seq_len=4)
# 9,024 FLOP/token at 50% of 18.048 MFLOP/s: exactly 1,000 tokens/s per device.
PEAK, MFU = 18.048e6, 0.5


def _speed_plan(accumulate: int, devices: int, activations: ActivationPolicy | None = None) -> PlanEstimate:
    inputs = PlanInputs(
        ONE_BLOCK,
        micro_batch=2,
        seq_len=4,
        accumulate=accumulate,
        devices=devices,
        activations=activations or ActivationPolicy(),
    )
    return estimate_plan(inputs, None, PEAK, 3.6, mfu=MFU, target_tokens=1e9)


# ---------------------------------------------------------------- speed: accumulation and world size


@pytest.mark.parametrize("accumulate", [1, 4])
def test_plan_step_time_covers_every_micro_batch_of_the_accumulation(accumulate):
    e = _speed_plan(accumulate, devices=8)
    assert e.train_flops_per_token == 9024
    assert e.speed.tokens_per_sec_per_device == pytest.approx(1000.0)
    # An optimizer step runs micro-batch 2 x 4 tokens x accumulate on each device: 8 tokens (8 ms) without
    # accumulation, 32 tokens (32 ms) with 4.
    assert e.speed.step_time_s == pytest.approx(8 * accumulate / 1000.0)
    # Time and dollars per token do not depend on how the global batch is split: 8 devices x 1,000 tokens/s do 1e9
    # tokens in 125,000 s = 34.72 h; 8 devices x $3.6/h x 125,000 s / 3600 = $1,000.
    assert e.speed.hours_to_target == pytest.approx(125_000 / 3600)
    assert e.speed.usd_to_target == pytest.approx(1000.0)
    assert e.speed.usd_per_1b_tokens == pytest.approx(1000.0)


def test_plan_recomputes_the_checkpointed_blocks_forward():
    # Checkpointing the one block replays it but its FFN down-projection (2 x 16 x 8 x 8 tokens = 2,048):
    # blocks 10,240 + attention 1,024 - 2,048 = 9,216 FLOPs more: (72,192 + 9,216) / 8 tokens = 10,176 per token.
    e = _speed_plan(1, devices=1, activations=ActivationPolicy(checkpoint_every=1))
    assert e.train_flops_per_token == 10_176
    assert e.speed.tokens_per_sec_per_device == pytest.approx(PEAK * MFU / 10_176)


def test_plan_recompute_fraction_rounds_the_checkpointed_blocks_up():
    # Three blocks, one sequence of 4 tokens: per block 2 x 640 x 4 + attention 4 x 2 x 4 x 4 x 4 = 5,632 (16,896
    # for three), lm_head 2 x 8 x 100 x 4 = 6,400; training 3 x 23,296 = 69,888. Every 2nd block checkpoints blocks
    # 0 and 2: 2 of 3, each replaying 5,632 - 2 x 16 x 8 x 4 = 4,608: 9,216 more, (69,888 + 9,216) / 4 = 19,776.
    cfg = GPTConfig(vocab_size=100, n_layers=3, d_model=8, n_heads=2, ffn_hidden=16, max_seq_len=4)
    inputs = PlanInputs(cfg, micro_batch=1, seq_len=4, activations=ActivationPolicy(checkpoint_every=2))
    e = estimate_plan(inputs, None, PEAK, None)
    assert e.train_flops_per_token == 19_776


# ---------------------------------------------------------------- the fit verdicts at their boundaries


def _verdict(
    peak: int,
    device_memory: int | None,
    headroom: int = 0,
    cpu: int = 0,
    host: int | None = None,
    headroom_fraction: float = 0.0,
    devices: int = 1,
    device_is_host: bool = False,
) -> PlanEstimate:
    terms = [Term("params", "device", "weights", peak), Term("optimizer_states", "cpu", "offloaded", cpu)]
    speed = SpeedEstimate(None, None, None, None, None, "none")
    inputs = PlanInputs(ONE_BLOCK, devices=devices)
    return PlanEstimate(
        inputs,
        MemoryEstimate.of(terms),
        speed,
        device_memory,
        0.0,
        headroom,
        host,
        headroom_fraction,
        device_is_host,
    )


def test_a_peak_equal_to_the_usable_device_memory_fits():
    # 1,100 bytes less 100 of headroom leave exactly the 1,000-byte peak.
    exact = _verdict(1000, 1100, headroom=100)
    assert (exact.device_fits, exact.fits, exact.margin_bytes) == (True, True, 0)
    over = _verdict(1000, 1099, headroom=100)
    assert (over.device_fits, over.fits, over.margin_bytes) == (False, False, -1)
    unknown = _verdict(1000, None)
    assert (unknown.device_fits, unknown.fits, unknown.margin_bytes) == (None, None, None)


def test_offloaded_bytes_equal_to_the_usable_host_memory_fit():
    # 300 offloaded bytes per rank x 4 devices per node = 1,200; a 1,600-byte node keeps a quarter (400) free.
    exact = _verdict(1000, 2000, cpu=300, devices=4, host=1600, headroom_fraction=0.25)
    assert exact.host_bytes_per_node == 1200
    assert exact.host_usable_bytes == 1200
    assert (exact.host_fits, exact.fits) == (True, True)
    # 1,596 - int(0.25 x 1,596 = 399) = 1,197 usable.
    short = _verdict(1000, 2000, cpu=300, devices=4, host=1596, headroom_fraction=0.25)
    assert short.host_usable_bytes == 1197
    assert (short.host_fits, short.device_fits, short.fits) == (False, True, False)
    # RAM unknown: no host verdict, and the device verdict stands (unknown device: unknown fit).
    assert _verdict(1000, 2000, cpu=300, host=None).host_fits is None
    assert _verdict(1000, None, cpu=300, host=None).fits is None


def test_a_cpu_device_counts_its_peak_against_the_host():
    # Per rank: 300 offloaded + the 1,000-byte device peak (the device is the host) = 1,300; x 4 ranks = 5,200.
    e = _verdict(1000, None, cpu=300, devices=4, host=5200, device_is_host=True)
    assert e.host_bytes_per_node == 5200
    assert e.host_fits is True
    assert _verdict(1000, None, cpu=300, devices=4, host=5199, device_is_host=True).host_fits is False
    # Nothing offloaded and the device is not the host: no RAM is needed.
    assert _verdict(1000, 2000, host=1).host_fits is True


# ---------------------------------------------------------------- MemoryEstimate.peak and resident bytes


def test_peak_is_what_lives_all_step_plus_the_larger_phase_with_its_in_step_temporaries():
    terms = (
        Term("params", "device", "weights", 100),
        Term("activations", "device", "saved", 50, phase="backward"),
        Term("grads", "device", ".grad", 30, phase="step"),
        Term("other", "device", "foreach temporary", 40, phase="in_step"),
        Term("optimizer_states", "cpu", "offloaded", 1000),
        Term("other", "cpu", "pinned staging", 7, phase="in_step"),
    )
    est = MemoryEstimate(terms)
    # 100 + max(backward 50, step 30 + in_step 40 = 70) = 170; the CPU terms are the CPU's: 1,000 + 7.
    assert est.peak() == 170
    assert est.peak("cpu") == 1007
    # A larger backward phase wins: 100 + max(50 + 60, 70) = 210.
    more = est + MemoryEstimate((Term("activations", "device", "more saved", 60, phase="backward"),))
    assert more.peak() == 210
    # Resident (a snapshot just before optimizer.step()): no backward-phase and no in-step bytes: 100 + 30.
    assert est.bytes(resident_only=True) == 130
    assert est.bytes() == 220
    assert est.per_device() == {
        "params": 100,
        "grads": 30,
        "optimizer_states": 0,
        "activations": 50,
        "other": 40,
        "total": 220,
    }
    assert est.by_location("optimizer_states") == {"device": 0, "cpu": 1000, "nvme": 0}


# ---------------------------------------------------------------- the search keeps candidates of unknown fit

MODEL = GPTConfig(name="m", vocab_size=256, n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, max_seq_len=64)
SMALL_SPACE = SearchSpace(
    precisions={"bf16": "bf16-mixed"},
    strategies={"zero2": StrategyLayout("zero2", "deepspeed", 2)},
    activations={"none": ActivationPolicy()},
    optimizers={"adamw": ADAMW},
    micro_batches=(1, 2, 4, 8, 16),
)


def test_search_keeps_every_candidate_when_the_device_memory_is_unknown():
    base = PlanInputs(MODEL, micro_batch=2, accumulate=4, seq_len=64, devices=8)
    est = partial(estimate_plan, device_memory_bytes=None, peak_flops=1e12, price_per_device_hour=None)
    ranked, n = search_plans(base, SMALL_SPACE, est)
    # 2 x 4 = 8 sequences per device: micro-batches 1, 2, 4, 8 divide it (16 does not), all of unknown fit.
    assert n == 4
    assert len(ranked) == 4
    assert {c.estimate.fits for c in ranked} == {None}
    # The global batch of 2 x 4 x 8 devices = 64 sequences is held at world size 8.
    pairs = {(c.estimate.inputs.micro_batch, c.estimate.inputs.accumulate) for c in ranked}
    assert pairs == {(1, 8), (2, 4), (4, 2), (8, 1)}


def test_rank_candidates_drops_only_what_is_known_not_to_fit():
    def candidate(name: str, memory: int | None, usd: float) -> Candidate:
        e = _verdict(1000, memory)
        speed = SpeedEstimate(1.0, 1.0, usd, 1.0, 1.0, "test")
        return Candidate({"strategy": name}, PlanEstimate(e.inputs, e.memory, speed, memory, 0.0))

    ranked = rank_candidates([candidate("zero2", 999, 1.0), candidate("zero3", None, 3.0), candidate("ddp", 1000, 2.0)])
    # 999 bytes do not hold the 1,000-byte peak; unknown memory stays, ranked by dollars.
    assert [c.choices["strategy"] for c in ranked] == ["ddp", "zero3"]


# ---------------------------------------------------------------- model states at accumulation > 1 and world size 8


@pytest.mark.parametrize("kind", ["single", "ddp", "fsdp"])
def test_accumulated_gradients_live_through_the_next_forward(kind):
    # 1,000 fp32 parameters on 1 rank: weights 4,000, AdamW 8,000 + 4 (step), .grad 4,000 (DDP: + 4,000 buckets).
    # With a 10,000-byte backward phase (activations) the gradients of a step without accumulation are freed before
    # the next forward (phase step: max(10,000, 4,000)); with accumulation they live through it (phase all).
    acts = MemoryEstimate((Term("activations", "device", "saved", 10_000, phase="backward"),))
    layout = StrategyLayout(kind=kind)
    buckets = 4000 if kind == "ddp" else 0
    one = estimate_model_states([[1000]], "32-true", layout, ADAMW, 1, accumulate=1)
    four = estimate_model_states([[1000]], "32-true", layout, ADAMW, 1, accumulate=4)
    assert [t.phase for t in one.terms if t.category == "grads"] == ["step"]
    assert [t.phase for t in four.terms if t.category == "grads"] == ["all"]
    # Whatever else the strategy holds during backward, accumulation adds the 4,000 bytes of gradients to the peak.
    assert (four + acts).peak() - (one + acts).peak() == 4000
    if kind != "fsdp":  # FSDP2 also holds units unsharded during backward
        assert (one + acts).peak() == 4000 + 8004 + buckets + 10_000


def test_zero2_at_world_size_8_counts_straddling_params_whole():
    # Ten 1,000-element params, flat 10,000 (a multiple of 2 x 8), partitions of 1,250. Every rank's partition
    # touches two params (e.g. rank 1's [1,250, 2,500) holds the straddling 2nd and the 3rd), 2,000 elements whole.
    layout = StrategyLayout(kind="deepspeed", zero_stage=2)
    est = estimate_model_states([[1000] * 10], "bf16-mixed", layout, ADAMW, 8)
    assert est.bytes("params") == 2 * 10_000  # flat bf16 weights, whole on every rank
    assert est.bytes("grads", resident_only=True) == 2 * 2000  # bf16 gradient partition
    assert est.bytes("grads") == 2 * 2000 + 4 * 1250  # + the fp32 gradient partition inside step()
    assert est.bytes("optimizer_states") == 4 * 1250 + 8 * 1250 + 4  # fp32 master + m + v + step
    # ZeRO-1 with accumulation also keeps the full bf16 .grad between boundaries; ZeRO-2 does not.
    zero1 = estimate_model_states(
        [[1000] * 10], "bf16-mixed", StrategyLayout(kind="deepspeed", zero_stage=1), ADAMW, 8, accumulate=4
    )
    assert zero1.bytes("grads") == 2 * 2000 + 4 * 1250 + 2 * 10_000
    zero2 = estimate_model_states([[1000] * 10], "bf16-mixed", layout, ADAMW, 8, accumulate=4)
    assert zero2.bytes("grads") == est.bytes("grads")


def test_zero3_at_world_size_8_partitions_each_param():
    # ceil(1,000 / 8) + ceil(10 / 8) = 125 + 2 = 127 elements per rank; the 10-element param (< 100) also stays whole.
    layout = StrategyLayout(kind="deepspeed", zero_stage=3, param_persistence_threshold=100)
    est = estimate_model_states([[1000, 10]], "bf16-mixed", layout, ADAMW, 8)
    assert est.bytes("params") == 2 * 127 + 2 * 10
    assert est.bytes("grads") == 2 * 127 + 4 * 127  # bf16 partition + fp32 partition inside step()
    assert est.bytes("optimizer_states") == 4 * 127 + 8 * 127 + 4
    other = {t.label: t.nbytes for t in est.terms if t.category == "other"}
    assert other["full gradient of one param before its reduce"] == 2 * 1000


@pytest.mark.parametrize(("kind", "expected"), [("fsdp", (500, 500, 1004)), ("ddp", (4000, 4000, 8004))])
def test_fsdp_shards_by_8_and_ddp_replicates_at_world_size_8(kind, expected):
    # bf16-mixed keeps fp32 weights and grads. FSDP2 at world 8: 1,000 / 8 = 125 elements of weights, grads and
    # two moments (+ step); DDP: everything whole, plus its 4,000-byte gradient buckets.
    est = estimate_model_states([[1000]], "bf16-mixed", StrategyLayout(kind=kind), ADAMW, 8)
    assert tuple(est.bytes(c) for c in ("params", "grads", "optimizer_states")) == expected
    if kind == "ddp":
        assert est.bytes("other") == 4000


def test_zero3_sub_groups_are_cut_by_partition_size_at_world_size_4():
    # Three 400-element params partition to 100 elements each per rank (300 in all). A sub-group of 150 takes
    # params until their partitions reach it: 100, then 200 >= 150 closes the first sub-group; the last param is
    # the second. A 300-element sub-group holds the whole group; the 8-element group (2 per rank) is always whole.
    from lightning_trainopt.planner.zero_infinity import zero3_sub_groups

    assert zero3_sub_groups([[400, 400, 400], [8]], 4, 150) == [[[400, 400], [400]], [[8]]]
    assert zero3_sub_groups([[400, 400, 400], [8]], 4, 300) == [[[400, 400, 400]], [[8]]]
    # A sub-group closes as soon as its partitions reach the size (stage3.py, _create_fp16_sub_groups: >=).
    assert zero3_sub_groups([[400, 400, 400]], 4, 200) == [[[400, 400], [400]]]
    assert zero3_sub_groups([[400, 400, 400]], 1, 150) == [[[400], [400], [400]]]


def test_a_plan_over_2_nodes_of_4_devices_runs_on_8():
    # The job's world is devices x nodes: 8 devices do 1e9 tokens at 1,000 tokens/s each in 125,000 s, as above.
    inputs = PlanInputs(ONE_BLOCK, micro_batch=2, seq_len=4, devices=4, num_nodes=2)
    assert inputs.world_size == 8
    e = estimate_plan(inputs, None, PEAK, 3.6, mfu=MFU, target_tokens=1e9)
    assert e.speed.hours_to_target == pytest.approx(125_000 / 3600)
    # ZeRO-3 partitions over all 8 ranks: the states equal those of one node of 8 devices.
    zero3 = StrategyLayout("zero3", "deepspeed", 3)
    two_nodes = estimate_plan(PlanInputs(MODEL, layout=zero3, devices=4, num_nodes=2, seq_len=64), None, None, None)
    one_node = estimate_plan(PlanInputs(MODEL, layout=zero3, devices=8, seq_len=64), None, None, None)
    assert two_nodes.memory.bytes("optimizer_states") == one_node.memory.bytes("optimizer_states")


@pytest.mark.parametrize(
    ("precision", "kind", "stage", "autocast", "compute_bytes"),
    [
        ("bf16-mixed", "ddp", 0, True, 2),
        # Lightning hands DeepSpeed a bf16 module instead of autocasting it.
        ("bf16-mixed", "deepspeed", 2, False, 2),
        ("bf16-true", "single", 0, False, 2),
        ("32-true", "single", 0, False, 4),
    ],
)
def test_autocast_and_compute_dtype_of_a_plan(precision, kind, stage, autocast, compute_bytes):
    inputs = PlanInputs(MODEL, trainer_precision=precision, layout=StrategyLayout(kind=kind, zero_stage=stage))
    assert (inputs.autocast, inputs.compute_bytes) == (autocast, compute_bytes)
    labels = {t.label for t in estimate_plan(replace(inputs, seq_len=64), None, None, None).memory.terms}
    # Only autocast saves a half copy of every Linear weight for backward.
    assert ("autocast half weight copies" in labels) is autocast


def test_gpt_param_groups_list_every_matrix_and_norm_weight_once():
    # Embedding 100 x 8; per block q, k, v, o 8 x 8 (2 kv heads of 4) and gate, up, down 8 x 16; norm weights of 8:
    # two per block and the final one. Tied: 800 + 640 + 24 = 1,464 = n_params; untied adds the 800-element head.
    assert gpt_param_groups(ONE_BLOCK) == [[800, 64, 64, 64, 64, 128, 128, 128], [8, 8, 8]]
    assert sum(map(sum, gpt_param_groups(ONE_BLOCK))) == ONE_BLOCK.n_params() == 1464
    untied = replace(ONE_BLOCK, tie_embeddings=False)
    assert gpt_param_groups(untied) == [[800, 64, 64, 64, 64, 128, 128, 128, 800], [8, 8, 8]]
    assert sum(map(sum, gpt_param_groups(untied))) == untied.n_params() == 2264


def test_plan_keeps_the_headroom_share_of_the_device_free():
    # 5% of 1,000,000 bytes kept free: the peak must fit 950,000.
    inputs = PlanInputs(ONE_BLOCK, micro_batch=1, seq_len=4)
    peak = estimate_plan(inputs, None, None, None).peak_device_bytes
    e = estimate_plan(inputs, 1_000_000, None, None, headroom_fraction=0.05)
    assert e.headroom_bytes == 50_000
    assert e.margin_bytes == 950_000 - peak
    # One byte more than the peak fits only without a headroom.
    assert estimate_plan(inputs, peak + 1, None, None).device_fits is True
    assert estimate_plan(inputs, peak + 1, None, None, headroom_fraction=0.05).device_fits is False
    with pytest.raises(ConfigError, match="plan.headroom_fraction"):
        estimate_plan(inputs, 1_000_000, None, None, headroom_fraction=1.0)


def test_plan_passes_the_accumulation_to_the_model_states():
    # ZeRO-1 keeps the full bf16 .grad between accumulation boundaries: 2 B x 1,464 parameters = 2,928 bytes.
    zero1 = StrategyLayout("zero1", "deepspeed", 1)

    def boundary_grads(accumulate: int) -> list[int]:
        inputs = PlanInputs(ONE_BLOCK, layout=zero1, micro_batch=1, seq_len=4, accumulate=accumulate, devices=2)
        return [t.nbytes for t in estimate_plan(inputs, None, None, None).memory.terms if "between" in t.label]

    assert boundary_grads(4) == [2928]
    assert boundary_grads(1) == []


def test_the_whole_peak_is_a_valid_utilisation():
    # At 100% of a 1e12 FLOP/s peak, 1e9 FLOPs per token run 1,000 tokens/s; 1,000 tokens per step take 1 s.
    s = estimate_speed(1e9, 1000, 1, 1e12, 1.0, None, 1e9)
    assert s.tokens_per_sec_per_device == pytest.approx(1000.0)
    assert s.step_time_s == pytest.approx(1.0)


def _ranked_candidate(name: str, tps: float, usd: float | None, policy: ActivationPolicy) -> Candidate:
    speed = SpeedEstimate(tps, 1.0, usd, 1.0, None if usd is None else 1.0, "test")
    inputs = PlanInputs(ONE_BLOCK, activations=policy)
    estimate = PlanEstimate(inputs, MemoryEstimate(), speed, None, 0.0)
    return Candidate({"strategy": "zero2", "activations": name}, estimate)


def test_without_a_price_the_fastest_candidate_ranks_first():
    slow = _ranked_candidate("none", 100.0, None, ActivationPolicy())
    fast = _ranked_candidate("checkpoint", 200.0, None, ActivationPolicy(checkpoint_every=1))
    assert [c.choices["activations"] for c in rank_candidates([slow, fast])] == ["checkpoint", "none"]


def test_at_equal_cost_fewer_activation_techniques_rank_first():
    policies = {
        "offload": ActivationPolicy(offload=True),
        "int8": ActivationPolicy(compress_bits=8),
        "checkpoint": ActivationPolicy(checkpoint_every=1),
        "every_2nd": ActivationPolicy(checkpoint_every=2),
        "none": ActivationPolicy(),
    }
    ranked = rank_candidates([_ranked_candidate(name, 1.0, 5.0, p) for name, p in policies.items()])
    assert [c.choices["activations"] for c in ranked] == ["none", "every_2nd", "checkpoint", "int8", "offload"]


def test_search_on_one_device_enumerates_no_ddp():
    space = replace(SMALL_SPACE, strategies={"ddp": StrategyLayout("ddp", "ddp"), **SMALL_SPACE.strategies})
    base = PlanInputs(MODEL, micro_batch=2, accumulate=2, seq_len=64, devices=1)
    est = partial(estimate_plan, device_memory_bytes=None, peak_flops=1e12, price_per_device_hour=None)
    ranked, n = search_plans(base, space, est)
    # 4 sequences per step: micro-batches 1, 2 and 4, under ZeRO-2 only (DDP needs two devices to mean anything).
    assert n == 3
    assert {c.choices["strategy"] for c in ranked} == {"zero2"}
    _, n_two = search_plans(replace(base, devices=2), space, est)
    assert n_two == 6


def test_fsdp_shards_round_up():
    # World 4: ceil(1,001 / 4) + ceil(10 / 4) = 251 + 3 = 254 elements per rank, fp32 under bf16-mixed; AdamW keeps
    # two moments per element and a step per tensor.
    est = estimate_model_states([[1001, 10]], "bf16-mixed", StrategyLayout(kind="fsdp"), ADAMW, 4)
    assert tuple(est.bytes(c) for c in ("params", "grads", "optimizer_states")) == (4 * 254, 4 * 254, 8 * 254 + 2 * 4)


def test_zero1_keeps_full_gradients_from_an_accumulation_of_2():
    layout = StrategyLayout(kind="deepspeed", zero_stage=1)
    one = estimate_model_states([[1000]], "bf16-mixed", layout, ADAMW, 2, accumulate=1)
    two = estimate_model_states([[1000]], "bf16-mixed", layout, ADAMW, 2, accumulate=2)
    assert two.bytes("grads") - one.bytes("grads") == 2 * 1000  # bf16 .grad of every parameter


def test_zero3_a_parameter_of_exactly_the_persistence_threshold_stays_gathered():
    # World 2, threshold 100: the 100-element param is persistent (kept whole, 2 x 100 bytes) beside its partition
    # of 50; the 1,000-element one is only partitioned (500).
    layout = StrategyLayout(kind="deepspeed", zero_stage=3, param_persistence_threshold=100)
    est = estimate_model_states([[1000, 100]], "bf16-mixed", layout, ADAMW, 2)
    assert est.bytes("params") == 2 * (500 + 50) + 2 * 100


def test_zero3_offload_of_an_fp32_model_keeps_an_fp32_master_partition_on_the_cpu():
    # World 2: 500 elements per rank; DeepSpeed's CPU Adam keeps the fp32 master copy (4 B) and two moments (8 B) on
    # the host, with no step tensor.
    layout = StrategyLayout(kind="deepspeed", zero_stage=3, offload_optimizer="cpu", offload_params="cpu")
    est = estimate_model_states([[1000]], "32-true", layout, OPTIMIZER_STATES["deepspeed_cpu_adam"], 2)
    assert est.bytes("optimizer_states", "cpu") == 4 * 500 + 8 * 500
    assert est.bytes("optimizer_states") == 0


# ---------------------------------------------------------------- activations: every k-th block, int8, the logits


def test_every_2nd_block_of_3_checkpoints_blocks_0_and_2():
    # Three blocks, 2 sequences of 4 tokens, fp32: blocks 0 and 2 keep only their input (8 tokens x 4 B x d 8 = 256
    # each), block 1 keeps everything.
    cfg = replace(ONE_BLOCK, n_layers=3)
    est = estimate_transformer_activations(cfg, 2, 4, 4, False, ActivationPolicy(checkpoint_every=2))
    by_label = {t.label: t.nbytes for t in est.terms}
    assert by_label["2 checkpointed block inputs"] == 2 * 256
    assert "1 full blocks" in by_label


@pytest.mark.parametrize(("compute_bytes", "expected"), [(2, (2 + 4) * 8 * 100), (4, (4 + 4) * 8 * 100)])
def test_backward_holds_the_logits_and_their_fp32_gradient(compute_bytes, expected):
    # 8 tokens x 100 logits: the logits in the compute dtype and their fp32 gradient.
    est = estimate_transformer_activations(ONE_BLOCK, 2, 4, compute_bytes, False)
    assert {t.label: t.nbytes for t in est.terms}["logits + their gradient"] == expected


@pytest.mark.parametrize(("numel", "expected"), [(1023, 4 * 1023), (1024, 1024 + 4 * 16), (1025, 17 * 64 + 4 * 17)])
def test_int8_compression_bytes_match_the_quantizer(numel, expected):
    # Below min_numel (1,024) an fp32 tensor is stored as it is; from it on, int8 codes padded to whole blocks of 64
    # plus an fp32 scale per block: 1,025 elements take 17 blocks.
    import torch

    from lightning_trainopt.planner.activations import compressed_bytes
    from lightning_trainopt.transforms.compression import quantize_blockwise

    policy = ActivationPolicy(compress_bits=8)
    assert compressed_bytes(4, numel, policy) == expected
    if numel >= policy.compress_min_numel:
        q = quantize_blockwise(torch.randn(numel), policy.compress_block)
        assert q.codes.numel() * q.codes.element_size() + q.scales.numel() * q.scales.element_size() == expected


# ---------------------------------------------------------------- optimizer states at the quantisation threshold


def test_a_tensor_of_exactly_4096_elements_gets_8bit_states():
    # bitsandbytes keeps fp32 states only below min_8bit_size=4096: at 4,096, two 8-bit moments (4,096 B each) with
    # an fp32 absmax per 256 elements (16 x 4 B each).
    bnb = OPTIMIZER_STATES["adamw8bit"]
    assert bnb.bytes_for([4096], 4) == 2 * (4096 + 4 * 16)
    assert bnb.bytes_for([4095], 4) == 2 * 4 * 4095
    # 5,000 elements fill 20 blocks of 256, the last one partly (bitsandbytes allocates absmax of 20 per moment).
    assert bnb.bytes_for([5000], 4) == 2 * (5000 + 4 * 20)


def test_torchao_keeps_full_precision_states_for_a_tensor_not_a_multiple_of_its_block():
    # 5,000 fp32 elements are not a multiple of 256: torchao keeps zeros_like(param) moments, 2 x 4 B each, + step.
    assert OPTIMIZER_STATES["adamw8bit_torchao"].bytes_for([5000], 4) == 4 + 2 * 4 * 5000


def test_a_measured_speed_gives_the_step_time_of_one_device():
    # 1,000 tokens per step on each device at a measured 500 tokens/s per device: 2 s a step, on 4 devices as on 1;
    # 1e9 tokens take 1e9 / (4 x 500) s.
    s = estimate_speed(1e9, 1000, 4, None, 0.4, None, 1e9, measured_tokens_per_sec_per_device=500.0)
    assert s.step_time_s == pytest.approx(2.0)
    assert s.hours_to_target == pytest.approx(1e9 / 2000 / 3600)
