"""Which layers convert to FP8 and why: shape thresholds, globs, the output projection, fp32-kept containers."""

import pytest
import torch
from torch import nn

from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.precision.layer_filter import (
    clean_name,
    matching_pattern,
    output_projections,
    plan_layers,
    shape_skip_reason,
)

TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=32)


@pytest.mark.parametrize(
    ("n", "k", "skipped"),
    [
        (1024, 4096, True),  # K <= 4096 and N <= 1024: below torchao's tensorwise break-even
        (1040, 4096, False),  # N > 1024
        (1024, 4112, False),  # K > 4096
        (8192, 2048, False),  # gpt_1b's gate/up projections
        (512, 2048, True),  # gpt_1b's k/v projections (8 KV heads x 64)
    ],
)
def test_tensorwise_threshold_is_torchaos(n, k, skipped):
    reason = shape_skip_reason(n, k, "tensorwise", skip_small=True)
    assert (reason is not None) == skipped
    if skipped:
        assert "tensorwise break-even" in reason


@pytest.mark.parametrize(
    ("n", "k", "skipped"),
    [(2048, 8192, True), (2064, 1040, True), (4096, 2048, True), (4112, 2048, False), (4096, 2064, False)],
)
def test_rowwise_threshold_is_torchaos(n, k, skipped):
    assert (shape_skip_reason(n, k, "rowwise", skip_small=True) is not None) == skipped


def test_the_divisibility_rule_holds_without_the_size_rule():
    assert "divisible by 16" in shape_skip_reason(64, 72, "tensorwise", skip_small=False)
    assert shape_skip_reason(64, 64, "tensorwise", skip_small=False) is None
    assert shape_skip_reason(64, 64, "tensorwise", skip_small=True) is not None


@pytest.mark.parametrize(
    ("name", "kind", "pattern", "hit"),
    [
        ("model.blocks.0.attn_norm", "RMSNorm", "RMSNorm", True),  # class name
        ("model.lm_head", "Linear", "lm_head", True),  # the end of the name, at a '.' boundary
        ("model.my_lm_head", "Linear", "lm_head", False),
        ("model.blocks.3.moe.router", "Linear", "*.router", True),
        ("model.blocks.0.mlp.up_proj", "Linear", "model.blocks.0.mlp.*", True),
        ("model.blocks.1.mlp.up_proj", "Linear", "model.blocks.0.mlp.*", False),
        ("model.blocks.0.input_layernorm", "LlamaRMSNorm", "*RMSNorm", True),  # a class-name glob
        ("model.blocks.0.input_layernorm", "LlamaRMSNorm", "rmsnorm", False),  # case matters
    ],
)
def test_patterns_match_classes_and_name_globs(name, kind, pattern, hit):
    assert (matching_pattern(name, kind, [pattern]) == pattern) == hit


def test_wrapper_parts_leave_the_name():
    assert clean_name("model._orig_mod.blocks.0._checkpoint_wrapped_module.attn") == "model.blocks.0.attn"


def test_output_projection_is_found_by_name_and_by_tied_weight():
    model = GPT(TINY)
    assert output_projections(model) == {id(model.lm_head)}
    renamed = nn.Sequential(model.embed, nn.Linear(64, 256, bias=False))
    renamed[1].weight = renamed[0].weight  # tied, under another name
    assert output_projections(renamed) == {id(renamed[1])}


def _by_name(decisions):
    return {d.name: d for d in decisions}


def test_gpt_plan_converts_blocks_and_keeps_the_lm_head():
    plan = _by_name(plan_layers(GPT(TINY), fp8_recipe="tensorwise", skip_small=False))
    assert plan["lm_head"].action == "bf16"
    assert "output projection" in plan["lm_head"].reason
    linears = [d for d in plan.values() if d.name != "lm_head"]
    assert len(linears) == 14
    assert all(d.action == "fp8" for d in linears)
    assert plan["blocks.0.mlp.down_proj"].shape == (64, 128)
    with_head = _by_name(plan_layers(GPT(TINY), fp8_recipe="tensorwise", skip_small=False, convert_lm_head=True))
    assert with_head["lm_head"].action == "fp8"


def test_include_and_exclude_globs():
    plan = _by_name(
        plan_layers(GPT(TINY), fp8_recipe="tensorwise", skip_small=False, include=["*.mlp.*"], exclude=["blocks.1.*"])
    )
    assert plan["blocks.0.mlp.up_proj"].action == "fp8"
    assert plan["blocks.1.mlp.up_proj"].reason == "precision.exclude names it ('blocks.1.*')"
    assert plan["blocks.0.attn.q_proj"].reason == "not named by precision.include"


def test_a_kept_fp32_container_keeps_its_children_out_of_fp8():
    plan = _by_name(plan_layers(GPT(TINY), ["*.mlp", "RMSNorm"], fp8_recipe="tensorwise", skip_small=False))
    assert plan["blocks.0.mlp"].action == "fp32"
    assert plan["blocks.0.mlp"].reason.endswith("('*.mlp')")
    assert not any(name.startswith("blocks.0.mlp.") for name in plan)
    assert plan["blocks.0.attn_norm"].action == "fp32"
    assert plan["blocks.0.attn.q_proj"].action == "fp8"


def test_small_layers_stay_bf16_by_default():
    plan = plan_layers(GPT(TINY), fp8_recipe="tensorwise")
    assert plan
    assert all(d.action == "bf16" for d in plan)


def test_without_fp8_only_kept_modules_are_listed():
    plan = plan_layers(GPT(TINY), ["lm_head"])
    assert [(d.name, d.action) for d in plan] == [("lm_head", "fp32")]


def test_compiled_models_are_planned_under_their_own_names():
    root = nn.Module()
    root.model = torch.compile(GPT(TINY))
    names = {d.name for d in plan_layers(root, fp8_recipe="tensorwise", skip_small=False)}
    assert "model.blocks.0.attn.q_proj" in names
    assert not any("_orig_mod" in n for n in names)


def test_te_plan_lists_the_norms_it_replaces():
    plan = _by_name(plan_layers(GPT(TINY), fp8_recipe="delayed", skip_small=False, te_norms=True))
    assert plan["blocks.0.attn_norm"].action == "bf16"
    assert "norm" in plan["blocks.0.attn_norm"].reason
    assert plan["norm"].kind == "RMSNorm"
