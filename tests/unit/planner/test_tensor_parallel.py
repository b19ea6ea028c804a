"""The planner under tensor parallelism, sequence parallelism and HSDP: bytes, Korthikanti's activations, TP time."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.metrics.hardware import HARDWARE, hardware_spec
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import ActivationPolicy, PlanInputs, StrategyLayout, estimate_plan, gpt_profile
from lightning_trainopt.planner.offload_time import Bandwidths
from lightning_trainopt.planner.tensor_parallel import korthikanti_layer_bytes, tp_comm, tp_param_groups, tp_refusal

# Published LLaMA-7B shape (conf/model/llama_7b.yaml); 8 KV heads to check GQA divisibility.
LLAMA_7B = GPTConfig(
    name="llama_7b", vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008, max_seq_len=4096
)
GQA = replace(LLAMA_7B, name="gqa", n_kv_heads=8)
FSDP = StrategyLayout(name="fsdp", kind="fsdp")
DDP = StrategyLayout(name="ddp", kind="ddp")
H100 = HARDWARE["h100_sxm"]
BW = Bandwidths(nvlink_bytes_per_s=H100.nvlink_bytes_per_s, network_bytes_per_s=H100.network_bytes_per_s)


def _plan(**kw):
    base = {"model": LLAMA_7B, "trainer_precision": "bf16-true", "layout": FSDP, "seq_len": 2048, "devices": 8}
    inputs = PlanInputs(**{**base, **kw})
    return estimate_plan(inputs, H100.memory_bytes, H100.peak("bf16"), 8.0, 0.4, bandwidths=BW)


def _term(e, text):
    return sum(t.nbytes for t in e.memory.terms if text in t.label)


def test_tp_splits_the_matrices_and_keeps_the_norm_vectors_whole():
    groups = gpt_profile(LLAMA_7B).param_groups
    split = tp_param_groups(groups, 4)
    assert split[1] == groups[1]  # 2 x 32 + 1 norm vectors of 4096, whole on every rank
    assert sum(split[0]) == sum(-(-k // 4) for k in groups[0])
    # DDP + TP 4 (no data-parallel sharding): each rank holds a quarter of the matrices, every norm.
    e = _plan(layout=DDP, tensor_parallel=4)
    expected = 2 * (sum(groups[0]) // 4 + sum(groups[1]))
    assert e.memory.per_device()["params"] == expected


def test_tp_then_fsdp_divides_the_states_by_the_whole_mesh_and_hsdp_only_by_a_replica_group():
    plain = _plan()  # FSDP2 over 8
    tp2 = _plan(tensor_parallel=2)  # TP 2 x FSDP2 over 4
    hsdp = _plan(tensor_parallel=2, replicate=2)  # TP 2 x (2 replicas x FSDP2 over 2)
    p_plain = _term(plain, "weight shards")
    p_tp = _term(tp2, "weight shards")
    # the same 1/8 of the matrices either way; norm vectors are split 8 ways by FSDP2 alone, 4 ways under TP 2
    assert abs(p_tp - p_plain) <= 2 * (2 * 32 + 1) * 4096
    assert _term(hsdp, "weight shards") == pytest.approx(2 * p_tp, rel=1e-6)
    assert hsdp.inputs.shard_size == 2
    assert tp2.inputs.shard_size == 4


def test_korthikanti_formulas():
    s, b, h, a = 2048, 1, 4096, 32
    assert korthikanti_layer_bytes(s, b, h, a, 1, False, True) == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, 8, False, True) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert korthikanti_layer_bytes(s, b, h, a, 8, True, True) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / 8)
    assert korthikanti_layer_bytes(s, b, h, a, 8, True, False) == s * b * h * 34 / 8


@pytest.mark.parametrize("sp", [True, False])
def test_block_activations_scale_by_korthikanti_and_sp_splits_checkpointed_inputs(sp):
    policy = ActivationPolicy(name="checkpoint_every_2nd", checkpoint_every=2)
    one = _plan(activations=policy)
    four = _plan(activations=policy, tensor_parallel=4, sequence_parallel=sp)
    ratio = (34 / 4) / 34 if sp else (10 + 24 / 4) / 34
    assert _term(four, "full blocks") == pytest.approx(_term(one, "full blocks") * ratio, rel=1e-6)
    ckpt = _term(one, "checkpointed block inputs")
    assert _term(four, "checkpointed block inputs") == pytest.approx(ckpt / 4 if sp else ckpt, rel=1e-6)
    assert _term(four, "logits + their gradient") == pytest.approx(_term(one, "logits + their gradient") / 4, rel=1e-6)


def test_tp_collectives_are_charged_over_nvlink_inside_a_node_and_the_network_across():
    mb, seq, acc = 2, 2048, 3
    inside = _plan(tensor_parallel=4, micro_batch=mb, accumulate=acc)
    m = mb * seq * 4096 * 2  # b·s·h·2 B
    nbytes = acc * 32 * 4 * 2 * 3 / 4 * m
    assert inside.speed.overhead is not None
    assert inside.speed.overhead.serial["TP collectives (NVLink)"] == pytest.approx(nbytes / 450e9)
    # compute: each rank does 1/4 of the replica's FLOPs; the collectives add to it
    compute = mb * seq * acc / 4 * inside.train_flops_per_token / (H100.peak("bf16") * 0.4)
    assert inside.speed.step_time_s == pytest.approx(compute + nbytes / 450e9)
    assert inside.speed.tokens_per_sec_per_device == pytest.approx(mb * seq * acc / 4 / inside.speed.step_time_s)
    across = tp_comm(LLAMA_7B, mb, seq, acc, 2, 16, True, 8, 0, 450e9, 50e9)
    assert across.link == "network"
    assert across.seconds == pytest.approx(acc * 32 * 8 * 15 / 16 * m / 50e9)
    recompute = tp_comm(LLAMA_7B, mb, seq, 1, 2, 4, True, 8, 32, 450e9, None)
    assert recompute.nbytes == pytest.approx(32 * 6 * 2 * 3 / 4 * m)  # a checkpointed layer repeats 2 of its 4
    unknown = tp_comm(LLAMA_7B, mb, seq, 1, 2, 4, True, 8, 0, None, None)
    assert unknown.seconds is None
    assert "hardware.nvlink_gb_per_s" in unknown.formula


def test_tp_costs_time_without_a_bandwidth_it_is_named_not_charged():
    e = _plan(tensor_parallel=2, micro_batch=1)
    no_bw = estimate_plan(e.inputs, H100.memory_bytes, H100.peak("bf16"), 8.0, 0.4)
    assert no_bw.speed.overhead is not None
    assert any("TP collectives" in item for item in no_bw.speed.overhead.not_charged)
    assert no_bw.speed.tokens_per_sec_per_device > e.speed.tokens_per_sec_per_device


def test_tp_refusals_name_the_key():
    with pytest.raises(IncompatibleConfigError, match="not under DeepSpeed"):
        PlanInputs(LLAMA_7B, layout=StrategyLayout("zero3", "deepspeed", 3), devices=8, tensor_parallel=2)
    with pytest.raises(IncompatibleConfigError, match="HSDP replicas exist for FSDP2 only"):
        PlanInputs(LLAMA_7B, layout=DDP, devices=8, replicate=2)
    with pytest.raises(IncompatibleConfigError, match="do not split"):
        PlanInputs(LLAMA_7B, layout=FSDP, devices=6, tensor_parallel=4)
    with pytest.raises(ConfigError, match="strategy.tensor_parallel_size=0"):
        PlanInputs(LLAMA_7B, layout=FSDP, devices=8, tensor_parallel=0)
    assert tp_refusal(GQA, 16, 2048, True) == "key/value heads 8 not divisible by tensor_parallel_size=16"
    assert "sequence length 2047" in tp_refusal(GQA, 8, 2047, True)
    assert tp_refusal(GQA, 8, 2047, False) == ""


def test_hardware_presets_carry_nvlink_and_network_with_their_sources_and_overrides():
    assert H100.nvlink_bytes_per_s == 450e9
    assert H100.network_bytes_per_s == 50e9
    assert "NVLink 900 GB/s" in H100.sources["nvlink"]
    assert HARDWARE["l4"].nvlink_bytes_per_s is None
    assert "nvlink_gb_per_s" in HARDWARE["l4"].sources["nvlink"]
    spec = hardware_spec("h100_sxm", nvlink_gb_per_s=300, network_gb_per_s=25)
    assert (spec.nvlink_bytes_per_s, spec.network_bytes_per_s) == (300e9, 25e9)
    with pytest.raises(ConfigError, match="hardware.nvlink_gb_per_s"):
        hardware_spec("h100_sxm", nvlink_gb_per_s=-1)


def _stub_profile(module, name, **tp):
    from lightning_trainopt.planner import MemoryEstimate, module_profile

    return module_profile(module, name, lambda *a: MemoryEstimate.of([]), lambda b, s: (6 * b * s, 0), **tp)


def test_a_module_without_a_tp_plan_is_refused_with_the_reason_and_plans_without_tp():
    from torch import nn

    profile = _stub_profile(nn.Sequential(nn.Linear(8, 8)), "Sequential")
    with pytest.raises(ConfigError, match="strategy.tensor_parallel_size") as err:
        PlanInputs(profile, layout=FSDP, devices=2, tensor_parallel=2)
    assert "no plan for Sequential" in str(err.value)
    assert "llama, mistral, qwen2" in str(err.value)
    assert PlanInputs(profile, layout=FSDP, devices=2).tensor_parallel == 1


def test_a_hf_profile_splits_the_flagged_parameters_and_the_search_tries_only_the_sizes_it_divides():
    from torch import nn
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_trainopt.parallel.tp import tp_shape, tp_sharded_parameters
    from lightning_trainopt.planner import OPTIMIZER_STATES, SearchSpace, search_plans
    from lightning_trainopt.planner.tensor_parallel import tp_profile

    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model: nn.Module = Qwen2ForCausalLM(cfg)
    shape = tp_shape(model)
    assert shape is not None
    assert (shape.n_heads, shape.kv_heads, shape.ffn_hidden, shape.n_layers) == (4, 2, 48, 2)
    profile = _stub_profile(model, "qwen2", tp_shape=shape, tp_sharded=tp_sharded_parameters(model))
    # Column-parallel q/k/v split their biases (32 + 16 + 16 per layer); norms (3 x 32 + 32) stay whole.
    biases = 2 * (32 + 16 + 16)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert tp_profile(profile, 2).n_params == matrices // 2 + biases // 2 + (2 * 2 * 32 + 32)
    base = PlanInputs(profile, "32-true", FSDP, micro_batch=2, seq_len=16, devices=8)
    space = SearchSpace(
        {"fp32": "32-true"}, {"fsdp": FSDP}, {"none": ActivationPolicy()}, {"adamw": OPTIMIZER_STATES["adamw"]},
        micro_batches=(2,), tensor_parallel=(1, 2, 4),
    )  # fmt: skip
    ranked, _ = search_plans(base, space, lambda i: estimate_plan(i, H100.memory_bytes, H100.peak("fp32"), 1.0))
    # 2 key/value heads: TP 4 is not tried, as train.py's pre-flight refuses it.
    assert sorted({c.estimate.inputs.tensor_parallel for c in ranked}) == [1, 2]
