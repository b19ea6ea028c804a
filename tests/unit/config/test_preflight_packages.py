"""A preset that needs an optional package is refused by the pre-flight check, naming the preset and the pip command."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_trainopt.config.preflight import (
    PreflightInput,
    optimizer_preset,
    preflight_from_cfg,
    required_packages,
)
from lightning_trainopt.exceptions import IncompatibleConfigError, MissingDependencyError, install_command
from tests.helpers.compose import TINY, compose_config

TORCH_PIN = f"torch=={torch.__version__.split('+', 1)[0]}"

# (overrides, the package to hide, the preset the refusal names, the pip extra it names)
NEEDS = [
    (["optimizer=adamw8bit"], ("bitsandbytes",), "optimizer=adamw8bit", "bnb"),
    (["optimizer=lion8bit"], ("bitsandbytes",), "optimizer=lion8bit", "bnb"),
    (["optimizer=adamw8bit_torchao"], ("torchao",), "optimizer=adamw8bit_torchao", "torchao"),
    (["optimizer=adamw4bit_torchao"], ("torchao",), "optimizer=adamw4bit_torchao", "torchao"),
    (["+strategy=zero2"], ("deepspeed",), "+strategy=zero2", "deepspeed"),
    (["logger=tensorboard"], ("tensorboard", "tensorboardX"), "logger=tensorboard", "tensorboard"),
]


def _cfg(overrides, tmp_path):
    return compose_config([*TINY, "trainer.accelerator=cpu", *overrides], tmp_path)


@pytest.mark.parametrize(("overrides", "hidden", "feature", "extra"), NEEDS)
def test_a_missing_package_is_refused_naming_the_preset_and_the_pinned_install(
    overrides, hidden, feature, extra, tmp_path, monkeypatch
):
    cfg = _cfg(overrides, tmp_path)
    preflight_from_cfg(cfg)  # installed here: accepted
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError, as when not installed
    with pytest.raises(MissingDependencyError) as err:
        preflight_from_cfg(cfg)
    message = str(err.value)
    assert message.startswith(f"{feature} needs the package {hidden[0]!r}, which is not installed.")
    assert message.endswith(f'pip install {TORCH_PIN} -e ".[{extra}]"')
    assert "lightning_trainopt." not in message


def test_the_default_config_needs_no_optional_package(tmp_path):
    # The default callbacks include GPUMonitor, which switches itself off without nvidia-ml-py.
    cfg = _cfg([], tmp_path)
    assert required_packages(_input(cfg)) == []


def _input(cfg):
    return PreflightInput(
        optimizer_target=cfg.optimizer._target_,
        precision=cfg.precision.trainer_precision,
        logger_targets=tuple((k, v.get("_target_", "")) for k, v in (cfg.logger or {}).items()),
    )


def test_tensorboardx_serves_for_tensorboard(tmp_path, monkeypatch):
    cfg = _cfg(["logger=tensorboard"], tmp_path)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", object())  # importable: Lightning's logger accepts it
    (needed,) = required_packages(_input(cfg))
    assert (needed.feature, needed.package, needed.alternatives) == (
        "logger=tensorboard",
        "tensorboard",
        ("tensorboardX",),
    )
    assert preflight_from_cfg(cfg) == []
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # neither: refused, naming the extra
    with pytest.raises(MissingDependencyError, match=r"\.\[tensorboard\]"):
        preflight_from_cfg(cfg)


def test_install_command_pins_the_installed_torch():
    assert install_command("cpu") == f'pip install {TORCH_PIN} -e ".[cpu]"'


def test_a_refused_combination_names_the_optimizer_preset_not_its_factory(tmp_path):
    cfg = _cfg(["optimizer=adamw8bit", "+strategy=zero2_offload"], tmp_path)
    with pytest.raises(IncompatibleConfigError) as err:
        preflight_from_cfg(cfg)
    assert str(err.value).startswith("optimizer='adamw8bit' + strategy='zero2_offload' is refused:")
    assert optimizer_preset("lightning_trainopt.optim.optimizers.torchao_adamw4bit") == "adamw4bit_torchao"
    assert optimizer_preset("torch.optim.AdamW") == "adamw"
    assert optimizer_preset("my.own.Optimizer") == "my.own.Optimizer"
