"""The planner's view of a model read from the module itself: param groups, tied weights, ZeRO-3 trace, FSDP2 units,
and the storage-by-storage activation rules of a measured forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import (
    ActivationPolicy,
    PlanInputs,
    StrategyLayout,
    decay_groups,
    estimate_plan,
    forward_trace,
    gpt_profile,
    module_profile,
)
from lightning_trainopt.planner.measure import (
    SavedStorages,
    fake_module,
    measure_saved_storages,
    measured_activation_terms,
)


def _unused(*_: object) -> object:
    raise AssertionError("not called by these tests")


def _llama(tie: bool) -> nn.Module:
    pytest.importorskip("transformers")
    from tests.helpers.hf import hf_model

    return hf_model("llama", tie_word_embeddings=tie)


def _profile(model: nn.Module, blocks: list[str]):
    x = torch.zeros(1, 8, dtype=torch.long)
    trace = forward_trace(model, lambda: model(x))
    return module_profile(model, "m", _unused, _unused, blocks, trace)  # type: ignore[arg-type]


# The tiny Llama of tests/helpers/hf.py: vocabulary 64, hidden 32, SwiGLU 64, 2 layers, 4 heads of 8, 2 kv heads.
V, D, F, KV = 64, 32, 64, 16
BLOCK_MATRICES = [D * D, D * KV, D * KV, D * D, D * F, D * F, F * D]  # q, k, v, o, gate, up, down
BLOCK = sum(BLOCK_MATRICES) + 2 * D  # + two RMSNorm weights


def test_param_groups_of_a_tiny_hf_llama_equal_a_hand_count():
    p = _profile(_llama(tie=False), ["LlamaDecoderLayer"])
    assert p.param_groups == (
        (V * D, *BLOCK_MATRICES, *BLOCK_MATRICES, V * D),  # embedding, 2 layers, lm_head: decayed
        (D,) * 5,  # 2 norms per layer + the final norm: not decayed
    )
    assert p.n_params == 2 * V * D + 2 * BLOCK + D == sum(t.numel() for t in _llama(tie=False).parameters())
    assert p.tied_numel == 0
    assert p.fsdp_units.blocks == (BLOCK, BLOCK)
    assert (p.fsdp_units.root, p.fsdp_units.head) == (2 * V * D + D, V * D)
    assert (p.n_blocks, p.block_class, p.measured) == (2, "LlamaDecoderLayer", True)


def test_a_tied_embedding_counts_once_and_is_one_parameter_in_the_trace():
    model = _llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    p = _profile(model, ["LlamaDecoderLayer"])
    assert p.param_groups[0] == (V * D, *BLOCK_MATRICES, *BLOCK_MATRICES)
    assert p.n_params == V * D + 2 * BLOCK + D
    assert p.tied_numel == V * D
    # ZeRO-3 fetches the same parameter for the embedding (first) and the head (last): one id in both.
    assert p.module_trace[0] == p.module_trace[-1] == ((0, V * D),)
    # FSDP2: the root unit holds it once; backward makes the head's gradient first.
    assert (p.fsdp_units.root, p.fsdp_units.head) == (V * D + D, V * D)


def test_frozen_parameters_are_not_planned_and_no_block_class_means_one_root_unit():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    assert decay_groups(model.parameters()) == ((16,), (8, 8, 2))
    p = _profile_seq(model)
    assert p.fsdp_units.blocks == ()
    assert p.fsdp_units.root == p.n_params == 16 + 8 + 8 + 2
    assert p.fsdp_units.head == 16 + 2  # the last module's own parameters


def _profile_seq(model: nn.Module):
    x = torch.zeros(3, 4)
    return module_profile(model, "seq", _unused, _unused, (), forward_trace(model, lambda: model(x)))  # type: ignore[arg-type]


@pytest.mark.parametrize("tie", [True, False])
def test_our_gpt_read_from_its_module_equals_its_analytic_profile(tie):
    from lightning_trainopt.models import GPT

    cfg = GPTConfig(
        name="t", vocab_size=256, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=172, tie_embeddings=tie
    )
    read, analytic = _profile(GPT(cfg), ["Block"]), gpt_profile(cfg)
    assert read.param_groups == analytic.param_groups
    assert read.module_trace == analytic.module_trace
    assert read.fsdp_units == analytic.fsdp_units
    assert read.tied_numel == analytic.tied_numel == (256 * 64 if tie else 0)


def test_a_plan_of_a_gpt_profile_equals_the_plan_of_its_config():
    cfg = GPTConfig(name="t", vocab_size=256, n_layers=2, d_model=64, n_heads=4, ffn_hidden=172, max_seq_len=64)
    for layout in (StrategyLayout(kind="deepspeed", zero_stage=3), StrategyLayout(kind="fsdp")):
        args = {"layout": layout, "micro_batch": 2, "seq_len": 32, "devices": 2}
        by_cfg = estimate_plan(PlanInputs(cfg, **args), 80 * 2**30, 1e14, 2.0)
        by_profile = estimate_plan(PlanInputs(gpt_profile(cfg), **args), 80 * 2**30, 1e14, 2.0)
        assert by_profile.memory == by_cfg.memory
        assert by_profile.train_flops_per_token == by_cfg.train_flops_per_token


def test_fake_module_keeps_shared_parameters_shared_and_casts():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    with FakeTensorMode():
        fake = fake_module(model, torch.bfloat16)
        assert fake[1].weight is fake[0].weight
        assert (fake[0].weight.device.type, fake[0].weight.dtype) == ("cpu", torch.bfloat16)
    assert model[0].weight.device.type == "meta"  # the original is left as it was


def test_saved_storages_of_a_fake_forward_equal_a_real_one():
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter

    x = torch.randn(16, 64)
    with SavedTensorsCounter(params=real.parameters()) as counter:
        real(x).sum()
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    saved = measure_saved_storages(lambda: fake_module(meta), lambda: torch.zeros(16, 64), lambda m, b: m(b).sum())
    assert saved.nbytes == counter.report().activation_bytes == 4 * 16 * (64 + 128 + 128)
    assert (saved.output_numel, saved.output_element_size) == (16 * 32, 4)


def test_measured_terms_compress_and_offload_storage_by_storage():
    # (bytes, element size, floating, weight copy): a 4096-element fp32 storage, a 512-element one, int64 ids.
    saved = SavedStorages(((4 * 4096, 4, True, False), (4 * 512, 4, True, False), (8 * 2048, 8, False, False)), 100)
    plain = measured_activation_terms(saved, ActivationPolicy(), 4)
    assert plain.bytes("activations") == 4 * 4096 + 4 * 512 + 8 * 2048
    int8 = measured_activation_terms(saved, ActivationPolicy(compress_bits=8), 4)
    # >= 1024 floating elements: int8 codes + an fp32 scale per 64; smaller storages and integers as they are.
    assert int8.bytes("activations") == (4096 + 4 * 64) + 4 * 512 + 8 * 2048
    offload = measured_activation_terms(saved, ActivationPolicy(offload=True), 4)
    assert offload.bytes("activations", "cpu") == 4 * 4096 + 8 * 2048
    assert offload.bytes("activations", "device") == 4 * 512
    assert offload.bytes("other", "cpu") == 0  # both moved storages are powers of two already
    assert plain.bytes("other") == (4 + 4) * 100  # the output and its fp32 gradient
    assert all(t.phase == "backward" for t in plain.terms)
