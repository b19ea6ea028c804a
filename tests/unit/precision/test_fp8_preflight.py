"""Pre-flight for FP8: the GPU's compute capability (faked), Transformer Engine on CPU or missing, the strategies."""

import pytest
import torch

from lightning_trainopt.config.preflight import PreflightInput, check_packages, preflight, required_packages
from lightning_trainopt.exceptions import IncompatibleConfigError, MissingDependencyError
from lightning_trainopt.parallel.spec import parse_strategy
from tests.helpers.compose import compose_config


def _gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _index=None: name)


def _fp8(backend: str = "torchao", **kwargs) -> PreflightInput:
    preset = "fp8" if backend == "torchao" else "fp8_te"
    args = {"precision": "bf16-mixed", "precision_preset": preset, "fp8_backend": backend, "transforms_model": True}
    return PreflightInput(**{**args, **kwargs})


def test_fp8_below_compute_capability_8_9_is_refused_naming_the_gpu(monkeypatch):
    _gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(IncompatibleConfigError) as err:
        preflight(_fp8(accelerator="gpu"))
    message = str(err.value)
    assert "NVIDIA A100-SXM4-80GB (compute capability 8.0)" in message
    assert "precision=bf16" in message
    assert "8.9" in message


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_gpus_pass(monkeypatch, capability):
    _gpu(monkeypatch, "NVIDIA H200", capability)
    assert preflight(_fp8(accelerator="gpu")) == []


def test_emulation_is_the_way_to_check_fp8_numerics_on_an_older_gpu(monkeypatch):
    _gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert preflight(_fp8(accelerator="gpu", fp8_emulate=True)) == []


def test_torchao_fp8_runs_emulated_on_cpu():
    assert preflight(_fp8(accelerator="cpu")) == []


def test_fp8_te_on_cpu_is_refused_with_the_alternative():
    with pytest.raises(IncompatibleConfigError, match=r"precision=fp8 \(torchao\)"):
        preflight(_fp8("transformer_engine", accelerator="cpu"))
    # ... before any package check: installing Transformer Engine would not help on a CPU.
    assert [r.package for r in required_packages(_fp8("transformer_engine", accelerator="cpu"))] == []


def test_fp8_te_without_transformer_engine_names_the_gpu_extra(monkeypatch):
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    needs = required_packages(_fp8("transformer_engine", accelerator="gpu"))
    with pytest.raises(MissingDependencyError, match=r"precision=fp8_te.*\[gpu\]"):
        check_packages(needs, importable=lambda name: name != "transformer_engine")


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_fp8_combines_with_every_strategy(strategy):
    cfg = compose_config(["precision=fp8", f"+strategy={strategy}", "trainer.accelerator=cpu"])
    assert all("FP8" not in line for line in preflight(cfg))


def test_lightnings_own_transformer_engine_plugin_is_still_refused_with_deepspeed():
    node = {"_target_": "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy", "stage": 2, "preset": "zero2"}
    with pytest.raises(IncompatibleConfigError, match="precision=fp8"):
        preflight(PreflightInput(strategy=parse_strategy(node), precision="transformer-engine", accelerator="gpu"))


def test_fp8_preset_is_read_from_the_config():
    cfg = compose_config(["precision=fp8_te", "trainer.accelerator=cpu"])
    with pytest.raises(IncompatibleConfigError, match="fp8_te"):
        preflight(cfg)
