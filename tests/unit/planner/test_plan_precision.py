"""plan(cfg) with FP8, fp32-kept modules, the chunked loss and model.attention: the run's layer decisions, the FP8
peak only where FP8 GEMMs run, the JSON and the screen."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lightning_trainopt.config.plan import plan
from lightning_trainopt.config.plan_precision import (
    _float8_sees_cpu_autocast,
    attention_kind,
    loss_plan,
    precision_plan,
)
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.compose import compose_config

TINY = ["model=gpt_tiny", "model.d_model=256", "model.ffn_hidden=688", "model.n_layers=2", "data.seq_len=128"]


def _plan(tmp_path, *overrides: str):
    return plan(compose_config([*TINY, *overrides], tmp_path, name="plan"))


def test_the_plan_converts_the_layers_the_run_converts(tmp_path):
    pytest.importorskip("torchao")
    from lightning_trainopt.config.model_factory import build_lightning_module
    from lightning_trainopt.precision import convert_model
    from lightning_trainopt.precision.convert import ConversionReport

    cfg = compose_config([*TINY, "precision=fp8", "precision.skip_small=false"], tmp_path, name="plan")
    planned = precision_plan(cfg, cfg.precision, on_cuda=True)
    assert planned is not None
    module = build_lightning_module(cfg)
    module.configure_model()
    from lightning_trainopt.config.plan_precision import precision_spec

    report: ConversionReport = convert_model(module, precision_spec(cfg.precision), emulate=True, fsdp=False)
    ran = [tuple(d.shape) for d in report.layers if d.action == "fp8"]
    assert list(planned.fp8_shapes) == ran
    assert len(ran) == 2 * 7  # every block linear; the lm_head kept in bf16 (convert_lm_head=false)
    assert [type(m).__name__ for m in module.modules()].count("Float8Linear") == len(ran)
    assert planned.emulated is False
    assert precision_plan(cfg, cfg.precision, on_cuda=False).emulated is True


def test_fp8_flops_run_at_the_fp8_peak_on_h100_and_not_on_a_cpu(tmp_path):
    pytest.importorskip("torchao")
    fp8 = ("precision=fp8", "precision.skip_small=false")
    bf16 = _plan(tmp_path, "hardware=h100", "precision=bf16").estimate
    h100 = _plan(tmp_path, "hardware=h100", *fp8).estimate
    assert 0 < h100.speed.fp8_flops_share < 1
    assert h100.speed.fp8_peak_flops == 1978.9e12
    assert h100.speed.peak_flops == bf16.speed.peak_flops == 989.4e12  # the implied MFU is against bf16's
    assert h100.speed.tokens_per_sec_per_device > bf16.speed.tokens_per_sec_per_device
    # A CPU emulates FP8: no FP8 peak, no speed-up invented (a bf16 peak given, so that a speed exists).
    peak = "+hardware.peak_tflops={bf16: 1.0}"
    cpu_bf16 = _plan(tmp_path, "hardware=cpu", peak, "precision=bf16").estimate
    cpu = _plan(tmp_path, "hardware=cpu", peak, *fp8).estimate
    assert cpu.speed.fp8_peak_flops is None
    assert cpu.speed.tokens_per_sec_per_device == cpu_bf16.speed.tokens_per_sec_per_device
    assert "emulated" in cpu.speed.source


def test_json_says_what_the_precision_and_the_loss_change(tmp_path):
    pytest.importorskip("torchao")
    d = _plan(
        tmp_path, "hardware=h100", "precision=fp8", "precision.skip_small=false", "precision.keep_fp32=[lm_head]"
    ).to_dict()
    changes = d["precision_changes"]
    assert changes["backend"] == "torchao"
    assert changes["fp8_layers"] == 14
    assert changes["fp32_modules"] == ["model.lm_head"]
    assert changes["activations"].startswith("measured")
    assert d["fp8_flops_share"] > 0.5
    assert d["fp8_peak_tflops"] == 1978.9
    plain = _plan(tmp_path, "hardware=h100", "precision=bf16").to_dict()
    assert plain["precision_changes"] is None
    assert plain["fp8_flops_share"] == 0.0
    assert plain["loss"] == "standard"
    assert plain["attention"] == "sdpa"


def test_a_gpu_plan_measures_float8_inputs_as_a_gpu_run_saves_them():
    # Float8Linear casts its input to the autocast dtype only under CUDA autocast: planning for a GPU, the
    # measurement must see the bf16 input a GPU run saves, not the fp32 one a CPU run saves.
    pytest.importorskip("torchao")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter
    from lightning_trainopt.precision import FP8PrecisionSpec, convert_model

    def saved(gpu_view: bool) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with FakeTensorMode():
                layer = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
                convert_model(layer, FP8PrecisionSpec("fp8", "bf16-mixed", skip_small=False), emulate=True, fsdp=False)
                x = torch.empty(64, 256)
                view = _float8_sees_cpu_autocast() if gpu_view else contextlib.nullcontext()
                with (
                    view,
                    SavedTensorsCounter(params=layer.parameters()) as c,
                    torch.autocast("cpu", dtype=torch.bfloat16),
                ):
                    layer(x).float().sum()
        return c.report().activation_bytes

    assert saved(False) == 4 * 64 * 256
    assert saved(True) == 2 * 64 * 256
    assert torch.is_autocast_enabled.__name__ == "is_autocast_enabled"  # restored


def test_attention_follows_model_attention():
    def cfg(model: str | None, planned: str) -> object:
        node = {"model": {} if model is None else {"attention": model}, "plan": {"attention": planned}}
        return OmegaConf.create(node)

    assert attention_kind(cfg(None, "sdpa")) == "sdpa"
    assert attention_kind(cfg("math", "sdpa")) == "math"
    assert attention_kind(cfg("flash", "sdpa")) == "sdpa"
    assert attention_kind(cfg("flash_attn", "sdpa")) == "sdpa"
    assert attention_kind(cfg(None, "math")) == "math"
    with pytest.raises(ConfigError, match="plan.attention"):
        attention_kind(cfg("flash", "math"))


def test_loss_node_to_plan():
    assert loss_plan(None) is None
    assert loss_plan(OmegaConf.create({})) is None
    chunked = loss_plan(
        OmegaConf.create(
            {"_target_": "lightning_trainopt.transforms.chunked_loss.ChunkedLMHeadLoss", "chunk_tokens": 256}
        )
    )
    assert chunked is not None
    assert (chunked.kind, chunked.chunk_tokens, chunked.name) == ("chunked", 256, "chunked_ce")
    liger = loss_plan(OmegaConf.create({"_target_": "lightning_trainopt.transforms.liger_loss.LigerLMHeadLoss"}))
    assert liger is not None
    assert liger.kind == "liger"
    with pytest.raises(ConfigError, match="loss._target_"):
        loss_plan(OmegaConf.create({"_target_": "pkg.FocalLoss"}))


_LOSS_PRESET = Path(__file__).resolve().parents[3] / "lightning_trainopt" / "conf" / "loss" / "chunked_ce.yaml"


@pytest.mark.skipif(not _LOSS_PRESET.is_file(), reason="the conf/loss presets are not in this tree")
def test_search_chooses_the_loss_and_writes_it(tmp_path):
    # 4,096 tokens per micro-batch, more than the preset's 1,024-token chunks, at an 8,192 vocabulary: the chunked
    # loss holds a quarter of the logits (fewer tokens than one chunk would hold more, and lose).
    shape = ["model=gpt_tiny", "model.vocab_size=8192", "data.seq_len=512", "data.batch_size=8"]
    overrides = [
        *shape,
        "hardware=h100",
        "plan.search=true",
        "plan.search_space.precision=[bf16]",
        "+plan.search_space.loss=[standard,chunked_ce]",
        "plan.search_space.strategy=[ddp]",
        "plan.search_space.activations=[none]",
        "plan.search_space.optimizer=[adamw]",
        "plan.search_space.micro_batch=[8]",
    ]
    result = plan(compose_config(overrides, tmp_path, name="plan"))
    assert {c.choices["loss"] for c in result.candidates} == {"standard", "chunked_ce"}
    winner = result.winner
    assert winner is not None
    assert winner.choices["loss"] == "chunked_ce"  # the same price, more memory left
    assert "loss=chunked_ce" in result.command


def test_plan_refuses_fp8_te_on_a_cpu_as_train_does(tmp_path):
    from lightning_trainopt.exceptions import IncompatibleConfigError

    with pytest.raises(IncompatibleConfigError, match="Transformer Engine"):
        _plan(tmp_path, "hardware=cpu", "precision=fp8_te")


def test_search_on_a_cpu_leaves_out_fp8_te(tmp_path):
    pytest.importorskip("torchao")
    result = _plan(
        tmp_path,
        "hardware=cpu",
        "hardware.memory_gb=64",
        "plan.search=true",
        "plan.search_space.precision=[bf16,fp8,fp8_te]",
        "plan.search_space.strategy=[ddp]",
        "plan.search_space.activations=[none]",
        "plan.search_space.optimizer=[adamw]",
        "plan.search_space.micro_batch=[16]",
    )
    assert {c.choices["precision"] for c in result.candidates} == {"bf16", "fp8"}
    fp8 = next(c for c in result.candidates if c.choices["precision"] == "fp8")
    assert fp8.estimate.inputs.precision is not None
    assert fp8.estimate.inputs.precision.emulated is True
