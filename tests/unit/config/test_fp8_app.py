"""train.py with FP8: compile=true compiles block by block, and the run's metrics hold the precision report."""

from __future__ import annotations

from lightning_trainopt._compat.torch_internals import is_compiled
from lightning_trainopt.config.model_factory import build_lightning_module
from tests.helpers.compose import TINY, compose_config
from tests.helpers.runif import RunIf


def test_fp8_compile_is_regional(tmp_path):
    module = build_lightning_module(compose_config(["precision=fp8", "compile=true"], tmp_path))
    module.configure_model()
    assert all(is_compiled(block) for block in module.model.blocks)
    assert not is_compiled(module.model.lm_head)
    # In place: no torch.compile wrapper around the model, so names and checkpoint keys are the eager model's.
    assert not any("_orig_mod" in name for name, _ in module.named_parameters())


def test_other_presets_keep_compiling_the_whole_model(tmp_path):
    module = build_lightning_module(compose_config(["precision=bf16", "compile=true"], tmp_path))
    module.configure_model()
    assert hasattr(module.model, "_orig_mod")


@RunIf(torchao=True)
def test_train_reports_the_fp8_layers(tmp_path):
    from lightning_trainopt.launch.train import train

    overrides = [*TINY, "precision=fp8", "precision.skip_small=false", "trainer.accelerator=cpu", "trainer.max_steps=2"]
    cfg = compose_config(overrides, tmp_path)
    metrics = train(cfg)
    layers = metrics["precision_layers"]
    assert (layers["backend"], layers["emulated"], layers["fp8_layers"]) == ("torchao", True, 14)
    assert metrics["status"] == "ok"
