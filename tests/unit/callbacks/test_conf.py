"""The callback and hardware presets compose and build their targets."""

import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import lightning_trainopt.callbacks as cbs
from lightning_trainopt.metrics.hardware import HardwareSpec

CONF = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "lightning_trainopt", "conf"))
HARDWARE = sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "hardware")) if f.endswith(".yaml"))


def _compose(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=overrides)


def test_default_switches_every_monitor_on_and_guards_can_be_added(tmp_path):
    cfg = _compose(
        [
            "callbacks=[default,non_finite_guard,warmup_cosine_lr]",
            f"callbacks.memory_snapshot.dirpath={tmp_path}",
            f"callbacks.model_checkpoint.dirpath={tmp_path}",
        ]
    )
    names = set(cfg.callbacks)
    assert names == {
        "model_checkpoint",
        "step_timer",
        "speed_monitor",
        "memory_breakdown",
        "cost_monitor",
        "gpu_monitor",
        "memory_snapshot",
        "non_finite_guard",
        "warmup_cosine_lr",
    }
    built = {name: instantiate(cfg.callbacks[name]) for name in names}
    # Every monitor and guard and the checkpoint; the memory techniques are switched on by the `activations` group
    # instead; train.py prints FitReport's table itself and always adds PrecisionReport (metrics.json's
    # precision_layers).
    techniques = {"ActivationCheckpointing", "ActivationCompression", "ActivationOffload", "MicroBatchFinder"}
    by_app = {"FitReport", "PrecisionReport"}
    assert {type(cb).__name__ for cb in built.values()} == set(cbs.__all__) - techniques - by_app
    assert isinstance(built["cost_monitor"].hardware, HardwareSpec)


@pytest.mark.parametrize("name", HARDWARE)
def test_hardware_presets_build(name):
    spec = instantiate(_compose([f"hardware={name}"]).hardware)
    assert isinstance(spec, HardwareSpec)
    assert spec.sources["price"]


def test_micro_batch_finder_preset_composes_with_the_default_list_and_refuses_without_a_budget_on_cpu(tmp_path):
    from lightning_trainopt.exceptions import ConfigError
    from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer

    base = ["callbacks=[default,micro_batch_finder]", f"callbacks.memory_snapshot.dirpath={tmp_path}"]
    cfg = _compose([*base, "callbacks.micro_batch_finder.budget_bytes=4e9"])
    assert "step_timer" in cfg.callbacks
    finder = instantiate(cfg.callbacks.micro_batch_finder)
    assert isinstance(finder, cbs.MicroBatchFinder)
    assert (finder.budget_bytes, finder.batch_arg_name) == (4_000_000_000, "batch_size")

    unset = instantiate(_compose(base).callbacks.micro_batch_finder)
    with pytest.raises(ConfigError) as err:
        tiny_trainer([unset], max_steps=1).fit(tiny_module(), datamodule=tiny_data())
    assert str(err.value) == (
        "callbacks.micro_batch_finder.budget_bytes=None is invalid: on CPU there is no allocator limit to probe: give "
        "the memory budget per process in bytes, e.g. callbacks.micro_batch_finder.budget_bytes=4e9."
    )
