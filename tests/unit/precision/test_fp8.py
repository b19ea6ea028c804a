"""FP8 presets: the spec, the plugin per strategy, emulated FP8 against bf16, Transformer Engine's swap."""

import copy
import sys
import types

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy, TrainOptFSDPStrategy, precision_needs
from lightning_trainopt.precision import (
    FP8PrecisionSpec,
    PrecisionSpec,
    TransformDeepSpeedPrecision,
    TransformMixedPrecision,
    convert_model,
    trainer_precision_kwargs,
)
from tests.helpers.runif import RunIf

TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=32)


def fp8(**kwargs) -> FP8PrecisionSpec:
    return FP8PrecisionSpec(name="fp8", trainer_precision="bf16-mixed", **{"skip_small": False, **kwargs})


def _root() -> nn.Module:
    torch.manual_seed(0)
    root = nn.Module()
    root.model = GPT(TINY)
    return root


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"backend": "apex"}, "precision.backend"),
        ({"recipe": "delayed"}, "precision.recipe"),  # a Transformer Engine recipe given to torchao
        ({"backend": "transformer_engine", "recipe": "rowwise"}, "precision.recipe"),
        ({"backend": "transformer_engine", "emulate": True}, "precision.emulate"),
        ({"trainer_precision": "16-mixed"}, "precision.trainer_precision"),
        ({"init_scale": 1024.0}, "precision.init_scale"),
        ({"exclude": "lm_head"}, "precision.exclude"),
        ({"skip_small": "no"}, "precision.skip_small"),
    ],
)
def test_spec_refuses_bad_values_naming_the_key(kwargs, key):
    args = {"name": "fp8", "trainer_precision": "bf16-mixed", **kwargs}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        FP8PrecisionSpec(**args)


def test_recipe_defaults_to_the_backends_first():
    assert fp8().recipe == "tensorwise"
    assert fp8(backend="transformer_engine").recipe == "delayed"


def test_each_strategy_gets_a_plugin_of_its_kind():
    spec = fp8()
    (ddp,) = trainer_precision_kwargs(spec, precision_needs(DDPStrategy()), "cpu")["plugins"]
    assert type(ddp) is TransformMixedPrecision
    assert not ddp.fsdp
    assert ddp.emulate
    assert ddp.device == "cpu"
    (ds,) = trainer_precision_kwargs(spec, precision_needs(TrainOptDeepSpeedStrategy(stage=3)), "cpu")["plugins"]
    assert isinstance(ds, TransformDeepSpeedPrecision)
    assert ds.precision == "bf16-mixed"
    (fsdp,) = trainer_precision_kwargs(spec, precision_needs(TrainOptFSDPStrategy()), "cpu")["plugins"]
    assert type(fsdp) is TransformMixedPrecision
    assert fsdp.fsdp
    (gpu,) = trainer_precision_kwargs(spec, None, "gpu")["plugins"]
    assert not gpu.emulate
    assert gpu.device == "cuda"


def test_keep_fp32_alone_gets_a_plugin_only_under_mixed_precision():
    bf16 = PrecisionSpec("bf16", "bf16-mixed", keep_fp32=["RMSNorm"])
    (plugin,) = trainer_precision_kwargs(bf16, None, "cpu")["plugins"]
    assert isinstance(plugin, TransformMixedPrecision)
    assert trainer_precision_kwargs(PrecisionSpec("fp32", "32-true", keep_fp32=["RMSNorm"]), None, "cpu") == {
        "precision": "32-true"
    }


@RunIf(torchao=True)
def test_emulated_fp8_trains_close_to_bf16():
    """One forward/backward of a tiny GPT: FP8 (torchao, emulated) against the same model under bf16 autocast."""
    bf16, f8 = _root(), _root()
    report = convert_model(f8, fp8(), emulate=True, fsdp=False)
    assert report.to_dict()["fp8_layers"] == 14
    assert type(f8.model.blocks[0].attn.q_proj).__name__ == "Float8Linear"
    x = torch.randint(0, 256, (4, 32))
    losses, grads = [], []
    for root in (bf16, f8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = root.model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in root.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item()
    assert cosine > 0.99
    # ... and FP8 really ran: the gradients are not bf16's.
    assert not torch.equal(grads[0], grads[1])


@RunIf(torchao=True)
def test_conversion_runs_once_and_keeps_parameters():
    root = _root()
    weight = root.model.blocks[0].mlp.up_proj.weight
    first = convert_model(root, fp8(), emulate=True, fsdp=False)
    assert root.model.blocks[0].mlp.up_proj.weight is weight  # the same Parameter: optimizer and ZeRO-3 keep it
    assert convert_model(root, fp8(), emulate=True, fsdp=False) is first
    assert root.model.lm_head.weight is root.model.embed.weight  # the tie survives


@RunIf(torchao=True)
@pytest.mark.parametrize(("recipe", "all_gather"), [("tensorwise", True), ("rowwise", False)])
def test_fsdp_float8_all_gather_only_with_tensorwise(recipe, all_gather):
    report = convert_model(_root(), fp8(recipe=recipe), emulate=True, fsdp=True)
    assert report.fsdp_float8_all_gather is all_gather
    assert "FP8 all-gather" in report.text() if all_gather else "FP8 all-gather" not in report.text()


def test_report_counts_and_weight_share():
    root = _root()
    report = convert_model(root, fp8(exclude=["*.mlp.*"], keep_fp32=["RMSNorm"]), emulate=True, fsdp=False)
    out = report.to_dict()
    assert (out["fp8_layers"], out["bf16_layers"], out["fp32_modules"]) == (8, 7, 5)
    attn = 8 * 64 * 64
    assert out["fp8_weight_fraction"] == pytest.approx(attn / (attn + 6 * 64 * 128 + 256 * 64))
    assert "precision.exclude names it" in report.text()


def test_a_preset_that_converts_nothing_counts_the_causes_and_names_the_settings():
    root = _root()
    linear = sum(isinstance(m, nn.Linear) for m in root.modules())
    out = convert_model(root, fp8(skip_small=True), emulate=True, fsdp=False).to_dict()
    assert (out["fp8_layers"], out["bf16_layers"]) == (0, linear)
    small = {
        "cause": "below_break_even",
        "layers": linear - 1,
        "why": "below torchao's break-even size, where FP8 is slower",
        "change": "precision.skip_small=false",
    }
    head = {
        "cause": "output_projection",
        "layers": 1,
        "why": "output projection",
        "change": "precision.convert_lm_head=true",
    }
    assert out["not_fp8"] == [small, head]
    assert out["warning"] == (
        f"no layer runs in FP8 (0 of {linear} linear layers): {linear - 1} below torchao's break-even size, where FP8 "
        "is slower (change: precision.skip_small=false); 1 output projection (change: precision.convert_lm_head=true)"
    )
    converted = convert_model(_root(), fp8(), emulate=True, fsdp=False).to_dict()
    assert (converted["fp8_layers"], converted["not_fp8"], converted["warning"]) == (linear - 1, [head], None)


class _FakeTE(types.ModuleType):
    """The slice of ``transformer_engine.pytorch`` the swap uses, on CPU: modules that record how they were built."""

    class Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, device=None):
            super().__init__(in_features, out_features, bias=bias, device=device)

    class RMSNorm(nn.Module):
        def __init__(self, hidden, eps=1e-5, device=None):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.empty(hidden, device=device))

    class LayerNorm(nn.LayerNorm):
        pass


def test_te_swap_gives_te_modules_the_same_parameters(monkeypatch):
    te = _FakeTE("transformer_engine.pytorch")
    package = types.ModuleType("transformer_engine")
    package.pytorch = te
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    root = _root()
    q_weight = root.model.blocks[0].attn.q_proj.weight
    norm_weight = root.model.blocks[1].mlp_norm.weight
    report = convert_model(root, fp8(backend="transformer_engine"), emulate=False, fsdp=False)
    assert type(root.model.blocks[0].attn.q_proj) is _FakeTE.Linear
    assert root.model.blocks[0].attn.q_proj.weight is q_weight
    assert type(root.model.blocks[1].mlp_norm) is _FakeTE.RMSNorm
    assert root.model.blocks[1].mlp_norm.weight is norm_weight
    assert root.model.blocks[1].mlp_norm.eps == TINY.norm_eps
    assert type(root.model.lm_head) is nn.Linear  # kept in bf16
    assert report.backend == "transformer_engine"
    assert not report.emulated


def test_te_missing_names_the_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    from lightning_trainopt.exceptions import MissingDependencyError

    with pytest.raises(MissingDependencyError, match=r"\[gpu\]"):
        convert_model(_root(), fp8(backend="transformer_engine"), emulate=False, fsdp=False)


@RunIf(fp8=True)
def test_real_fp8_gemms_on_the_gpu():
    """torchao without emulation on an FP8 GPU: the forward calls torch._scaled_mm, and the loss is near bf16's."""
    bf16 = _root().cuda()
    f8 = copy.deepcopy(bf16)
    convert_model(f8, fp8(), emulate=False, fsdp=False)
    x = torch.randint(0, 256, (4, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a = bf16.model.loss(x[:, :-1], x[:, 1:])
        b = f8.model.loss(x[:, :-1], x[:, 1:])
    b.backward()
    assert b.item() == pytest.approx(a.item(), rel=0.02)


@RunIf(fp8=True, transformer_engine=True)
def test_transformer_engine_fp8_forward_backward_on_the_gpu():
    spec = fp8(backend="transformer_engine")
    (plugin,) = trainer_precision_kwargs(spec, None, "gpu")["plugins"]
    root = _root().cuda()
    reference = copy.deepcopy(root)
    plugin.convert_module(root)
    assert type(root.model.blocks[0].attn.q_proj).__module__.startswith("transformer_engine")
    x = torch.randint(0, 256, (4, 32), device="cuda")
    with plugin.forward_context():
        loss = root.model.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = reference.model.loss(x[:, :-1], x[:, 1:])
    assert loss.item() == pytest.approx(expected.item(), rel=0.02)
    # Delayed scaling keeps its amax history in the module's extra state: it goes into the checkpoint.
    assert any(key.endswith("_extra_state") for key in root.state_dict())


@RunIf(torchao=True)
def test_evaluation_steps_leave_inference_mode_for_torchao():
    """torchao's FP8 tensors fail under inference_mode with autocast (aten.to.dtype); the plugin evaluates under
    no_grad instead, as Lightning's single-device and DDP evaluation loops use inference_mode."""
    (plugin,) = trainer_precision_kwargs(fp8(), None, "cpu")["plugins"]
    root = _root()
    plugin.convert_module(root)
    x = torch.randint(0, 256, (2, 16))
    with torch.inference_mode():
        with pytest.raises(NotImplementedError, match="aten.to.dtype"), plugin.forward_context():
            root.model(x)
        for context in (plugin.val_step_context, plugin.test_step_context, plugin.predict_step_context):
            with context():
                logits = root.model(x)
            assert logits.dtype == torch.bfloat16
            assert not logits.requires_grad


@RunIf(torchao=True)
def test_fsdp2_weights_all_gather_in_fp8_and_get_precomputed_scales():
    """Under fully_shard the FP8 weights are torchao's all-gather subclass, and the plugin's step hook fills their
    scale (one all-reduce for all weights) - on a one-process gloo group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    (plugin,) = trainer_precision_kwargs(fp8(), precision_needs(TrainOptFSDPStrategy()), "cpu")["plugins"]
    root = _root()
    plugin.convert_module(root)
    mesh = init_device_mesh("cpu", (1,))
    for block in root.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(root.model, mesh=mesh)
    weight = root.model.blocks[0].attn.q_proj.weight
    assert type(weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert weight._local_tensor._precomputed_scale is None
    plugin._after_step(root)
    assert weight._local_tensor._precomputed_scale is not None
