"""train.py with FP8: compile=true compiles block by block (the rewrite's step); metrics hold the precision report."""

from __future__ import annotations

from typing import Any

from lightning_trainopt._compat.torch_internals import is_compiled
from lightning_trainopt.config.model_factory import build_lightning_module
from lightning_trainopt.config.rewrite import install_app_rewrites
from lightning_trainopt.parallel.apply import rewrite_report
from tests.helpers.compose import TINY, compose_config
from tests.helpers.runif import RunIf


def _compiled_by_the_app(overrides: list[str], tmp_path) -> Any:
    """Built and rewritten as train.py does: compile=true is the model rewrite's step at configure_model."""
    cfg = compose_config(overrides, tmp_path)
    module = build_lightning_module(cfg)
    install_app_rewrites(module, [], compile_model=bool(cfg.compile))
    module.configure_model()
    return module


def test_fp8_compile_is_regional(tmp_path):
    module = _compiled_by_the_app(["precision=fp8", "compile=true"], tmp_path)
    assert all(is_compiled(block) for block in module.model.blocks)
    assert not is_compiled(module.model.lm_head)
    # In place: no torch.compile wrapper around the model, so names and checkpoint keys are the eager model's.
    assert not any("_orig_mod" in name for name, _ in module.named_parameters())


def test_other_presets_compile_block_by_block_too(tmp_path):
    # One way to compile: the rewrite's compile step, whatever the precision.
    module = _compiled_by_the_app(["precision=bf16", "compile=true"], tmp_path)
    assert all(is_compiled(block) for block in module.model.blocks)
    assert not hasattr(module.model, "_orig_mod")
    assert rewrite_report(module).compiled == [f"model.blocks.{i}" for i in range(len(module.model.blocks))]


@RunIf(torchao=True)
def test_train_reports_the_fp8_layers(tmp_path):
    from lightning_trainopt.launch.train import train

    overrides = [*TINY, "precision=fp8", "precision.skip_small=false", "trainer.accelerator=cpu", "trainer.max_steps=2"]
    cfg = compose_config(overrides, tmp_path)
    metrics = train(cfg)
    layers = metrics["precision_layers"]
    assert (layers["backend"], layers["emulated"], layers["fp8_layers"]) == ("torchao", True, 14)
    assert metrics["status"] == "ok"
