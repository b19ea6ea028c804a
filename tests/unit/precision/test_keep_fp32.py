"""fp32-kept modules: fp32 output under bf16 autocast and with bf16 parameters, equal to an fp32 run of the module."""

import copy

import pytest
import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.precision import PrecisionSpec, convert_model, is_kept_fp32, keep_in_fp32

TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=32)


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 32)


def test_kept_module_ignores_autocast_and_equals_the_fp32_run():
    layer = _linear()
    x = torch.randn(8, 64)
    reference = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # the control: autocast does reach a plain layer
        keep_in_fp32(layer)
        out = layer(x.bfloat16())
    assert is_kept_fp32(layer)
    assert out.dtype == torch.float32
    # The bf16 input is cast up, so the reference gets the same rounded input.
    torch.testing.assert_close(out, layer.__dict__["_trainopt_fp32_original_forward"](x.bfloat16().float()))
    assert not torch.equal(out, reference)  # the input was bf16, so it differs from the fp32-input run
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), reference)


def test_half_precision_parameters_compute_in_fp32_and_get_their_gradient():
    layer = _linear()
    reference = copy.deepcopy(layer).bfloat16().float()  # the same bf16-rounded weights, held in fp32
    layer.bfloat16()  # as DeepSpeed's bf16 mode holds every parameter
    keep_in_fp32(layer)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, reference(x.float()))
    out.sum().backward()
    reference(x.float()).sum().backward()
    assert layer.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(layer.weight.grad.float(), reference.weight.grad, rtol=1e-2, atol=1e-2)
    assert layer.weight.dtype == torch.bfloat16  # the parameter is back after the forward


def test_a_deep_copy_runs_its_own_weights():
    layer = _linear()
    keep_in_fp32(layer)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    x = torch.randn(2, 64)
    assert torch.equal(twin(x), torch.zeros(2, 32))
    assert not torch.equal(layer(x), torch.zeros(2, 32))


def test_keep_fp32_in_a_gpt_under_bf16_autocast():
    model = nn.Module()
    model.model = GPT(TINY)
    report = convert_model(
        model, PrecisionSpec("bf16", "bf16-mixed", keep_fp32=["RMSNorm", "lm_head"]), emulate=False, fsdp=False
    )
    assert {d.name for d in report.layers} == {
        "model.blocks.0.attn_norm",
        "model.blocks.0.mlp_norm",
        "model.blocks.1.attn_norm",
        "model.blocks.1.mlp_norm",
        "model.norm",
        "model.lm_head",
    }
    seen = {}

    def record(name):
        def hook(_module, _inputs, out):
            seen[name] = out.dtype

        return hook

    model.model.lm_head.register_forward_hook(record("lm_head"))
    model.model.blocks[0].attn.q_proj.register_forward_hook(record("q"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.model(torch.randint(0, 256, (2, 16)))
    assert logits.dtype == torch.float32
    assert seen == {"lm_head": torch.float32, "q": torch.bfloat16}


@pytest.mark.parametrize("value", ["RMSNorm", [""], [3]])
def test_keep_fp32_takes_a_list_of_names(value):
    with pytest.raises(ConfigError, match="precision.keep_fp32"):
        PrecisionSpec("bf16", "bf16-mixed", keep_fp32=value)


def test_keep_fp32_needs_a_mixed_precision():
    with pytest.raises(ConfigError, match="mixed preset"):
        PrecisionSpec("bf16_true", "bf16-true", keep_fp32=["RMSNorm"])
    assert not PrecisionSpec("fp32", "32-true", keep_fp32=["RMSNorm"]).transforms_model
    assert PrecisionSpec("bf16", "bf16-mixed", keep_fp32=["RMSNorm"]).transforms_model
