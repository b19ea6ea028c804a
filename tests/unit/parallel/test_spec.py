"""One reading of a strategy node: every preset parses, a JSON and its preset agree, defaults come from the classes."""

from __future__ import annotations

import inspect
import json
from dataclasses import replace
from typing import Any

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy
from omegaconf import OmegaConf

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy, TrainOptFSDPStrategy
from lightning_trainopt.parallel.spec import (
    AUTO,
    DEEPSPEED_DEFAULTS,
    StrategySpec,
    class_defaults,
    parse_strategy,
    spec_of,
)
from lightning_trainopt.planner.model_states import MODEL_SIZED_BUCKET_CAP
from tests.helpers.compose import REPO_ROOT

PRESETS = sorted(p.stem for p in (REPO_ROOT / "lightning_trainopt" / "conf" / "strategy").glob("*.yaml"))
DEEPSPEED_PRESETS = [p for p in PRESETS if p.startswith("zero")]
OURS = "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy"
LIGHTNINGS = "lightning.pytorch.strategies.DeepSpeedStrategy"
# (kind, zero stage, offload of optimizer states, of parameters) each preset stands for, as docs/strategies.md says.
MEANING = {
    "ddp": ("ddp", 0, "none", "none"),
    "deepspeed_json": ("deepspeed", 2, "cpu", "none"),  # what the JSON written by _preset() says
    "fsdp": ("fsdp", 0, "none", "none"),
    "fsdp_offload": ("fsdp", 0, "cpu", "cpu"),
    "fsdp_tp": ("fsdp", 0, "none", "none"),
    "tp": ("fsdp", 0, "none", "none"),
    "zero1": ("deepspeed", 1, "none", "none"),
    "zero2": ("deepspeed", 2, "none", "none"),
    "zero2_offload": ("deepspeed", 2, "cpu", "none"),
    "zero3": ("deepspeed", 3, "none", "none"),
    "zero3_offload": ("deepspeed", 3, "cpu", "cpu"),
    "zero_infinity": ("deepspeed", 3, "nvme", "nvme"),
}


def _preset(name: str, tmp_path=None) -> dict[str, Any]:
    node = OmegaConf.to_container(
        OmegaConf.load(REPO_ROOT / "lightning_trainopt" / "conf" / "strategy" / f"{name}.yaml")
    )
    assert isinstance(node, dict)
    if name == "deepspeed_json":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
        node["config"] = str(path)
    return node


def test_the_meaning_table_covers_every_preset():
    assert sorted(MEANING) == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_parses_to_what_it_stands_for(name, tmp_path):
    spec = parse_strategy(_preset(name, tmp_path))
    assert spec.name == name
    assert (spec.kind, spec.zero_stage, spec.offload_optimizer, spec.offload_params) == MEANING[name]
    assert spec.offload == {"optimizer": MEANING[name][2], "param": MEANING[name][3]}
    assert spec.offload_by_category == {"optimizer_states": MEANING[name][2], "params": MEANING[name][3]}
    assert (spec.zero is not None) == (spec.kind == "deepspeed")
    assert spec.from_json == (name == "deepspeed_json")


def test_no_strategy_is_lightnings_choice():
    assert parse_strategy(None) == StrategySpec(name="auto", kind="none")


@pytest.mark.parametrize("name", DEEPSPEED_PRESETS)
def test_the_strategy_train_py_builds_means_what_the_preset_parses_to(name):
    # Lightning writes the DeepSpeed config from the keyword arguments; the spec reads the same arguments without
    # building anything. Both must agree, including the defaults neither the preset nor the user gives.
    pytest.importorskip("deepspeed")
    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.precision import PrecisionSpec

    node = _preset(name)
    built = build_strategy(node, PrecisionSpec(name="bf16", trainer_precision="bf16-mixed"), {}, n_params=836_736)
    parsed = parse_strategy(node).with_buckets_for(836_736)
    assert (built.spec.kind, built.spec.offload, built.spec.zero) == (parsed.kind, parsed.offload, parsed.zero)


@pytest.mark.parametrize("name", DEEPSPEED_PRESETS)
def test_a_json_of_the_config_lightning_writes_for_a_preset_gives_the_same_spec(name):
    pytest.importorskip("deepspeed")
    node = _preset(name)
    kwargs = {k: v for k, v in node.items() if k not in ("_target_", "name")}
    config = TrainOptDeepSpeedStrategy(**{**kwargs, "reduce_bucket_size": 7, "allgather_bucket_size": 7}).config
    from_json = parse_strategy({"_target_": OURS, "preset": name, "config": config})
    from_preset = parse_strategy({**node, "reduce_bucket_size": 7, "allgather_bucket_size": 7})
    assert from_json.from_json
    assert not from_preset.from_json
    assert from_json == from_preset


def test_a_hand_written_json_equals_the_zero3_offload_preset(tmp_path):
    ds = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
            # What the preset sets, and Lightning's defaults where DeepSpeed's own differ (1e12 sub-groups).
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 10_000,
            "sub_group_size": 1e12,
        }
    }
    from_json = parse_strategy({**_preset("deepspeed_json", tmp_path), "config": ds})
    assert from_json == replace(parse_strategy(_preset("zero3_offload")), name="deepspeed_json")


def _signature_defaults(cls: type) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if p.default is not p.empty}


def test_keyword_defaults_are_lightnings_signature_defaults():
    lightning = _signature_defaults(DeepSpeedStrategy)
    spec = parse_strategy({"_target_": LIGHTNINGS, "offload_optimizer": True, "offload_parameters": True})
    zero = spec.zero
    assert zero is not None
    assert zero.stage == lightning["stage"]
    assert (zero.overlap_comm, zero.contiguous_gradients) == (
        lightning["overlap_comm"],
        lightning["contiguous_gradients"],
    )
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (
        lightning["reduce_bucket_size"],
        lightning["allgather_bucket_size"],
    )
    assert zero.sub_group_size == lightning["sub_group_size"]
    assert (spec.offload_optimizer, spec.offload_params) == (
        lightning["offload_optimizer_device"],
        lightning["offload_params_device"],
    )
    assert zero.optimizer_buffer_count == lightning["optimizer_buffer_count"]
    assert (zero.params_buffer_count, zero.params_buffer_size) == (
        lightning["params_buffer_count"],
        lightning["params_buffer_size"],
    )
    assert zero.max_in_cpu == lightning["max_in_cpu"]
    # Lightning's class has no persistence argument: DeepSpeed's own default applies.
    assert zero.param_persistence_threshold == DEEPSPEED_DEFAULTS["param_persistence_threshold"]


def test_our_classes_defaults_are_their_signature_defaults():
    ours = _signature_defaults(TrainOptDeepSpeedStrategy)
    zero3 = parse_strategy({"_target_": OURS, "stage": 3}).zero
    assert zero3 is not None
    assert zero3.param_persistence_threshold == ours["param_persistence_threshold"] != 100_000
    fsdp = _signature_defaults(TrainOptFSDPStrategy)
    spec = parse_strategy({"_target_": "lightning_trainopt.parallel.TrainOptFSDPStrategy"})
    assert spec.reshard_after_forward is fsdp["reshard_after_forward"]
    assert spec.offload_params == ("cpu" if fsdp["cpu_offload"] else "none")
    assert spec.name == fsdp["preset"]


class Drifted(DeepSpeedStrategy):
    """A DeepSpeed strategy whose defaults differ from every number the project knows."""

    def __init__(self, stage: int = 1, reduce_bucket_size: int = 123, sub_group_size: int = 45, **kwargs: Any):
        super().__init__(stage=stage, reduce_bucket_size=reduce_bucket_size, sub_group_size=sub_group_size, **kwargs)


def test_defaults_follow_the_class_the_node_names_not_literals():
    # A literal in the spec (2e8, 1e12, stage 2) would survive a change of the class's default; this would not.
    spec = parse_strategy({"_target_": f"{Drifted.__module__}.Drifted"})
    assert spec.kind == "deepspeed"  # by subclass, whatever its name
    assert spec.name == "drifted"
    zero = spec.zero
    assert zero is not None
    assert (zero.stage, zero.reduce_bucket_size, zero.sub_group_size) == (1, 123, 45)
    assert zero.allgather_bucket_size == _signature_defaults(DeepSpeedStrategy)["allgather_bucket_size"]
    assert class_defaults(Drifted)["stage"] == 1


def test_deepspeeds_json_defaults_are_deepspeeds_own():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    models = {
        "": DeepSpeedZeroConfig,
        "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
        "offload_param": DeepSpeedZeroOffloadParamConfig,
    }
    for path, value in DEEPSPEED_DEFAULTS.items():
        block, _, name = path.rpartition(".")
        default = models[block].model_fields[name].default
        assert value == getattr(default, "value", default), path
    assert DeepSpeedZeroConfig.model_fields["overlap_comm"].default is None  # decided by the stage, as parsed
    spec = parse_strategy({"_target_": LIGHTNINGS, "config": {"zero_optimization": {"stage": 3}}})
    assert spec.zero is not None
    assert spec.zero.overlap_comm is True


def test_auto_buckets_are_sized_to_the_model_at_most_the_cap():
    spec = parse_strategy(_preset("zero2"))
    assert spec.zero is not None
    assert spec.zero.reduce_bucket_size == AUTO
    small = spec.with_buckets_for(1000).zero
    assert small is not None
    assert (small.reduce_bucket_size, small.allgather_bucket_size) == (1000, 1000)
    large = spec.with_buckets_for(None).zero
    assert large is not None
    assert large.reduce_bucket_size == MODEL_SIZED_BUCKET_CAP
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size"):
        parse_strategy({"_target_": OURS, "config": {"zero_optimization": {"stage": 2, "reduce_bucket_size": AUTO}}})


def test_a_users_nvme_json_names_its_own_keys_and_paths():
    zero = {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
        "offload_param": {"device": "nvme", "nvme_path": "/b"},
    }
    spec = parse_strategy({"_target_": OURS, "config": {"zero_optimization": zero}})
    assert spec.nvme_swaps() == [
        ("optimizer", "strategy.config.zero_optimization.offload_optimizer.nvme_path", "/a"),
        ("param", "strategy.config.zero_optimization.offload_param.nvme_path", "/b"),
    ]
    preset = parse_strategy({**_preset("zero_infinity"), "nvme_path": "/c"})
    assert preset.nvme_swaps() == [("optimizer", "strategy.nvme_path", "/c"), ("param", "strategy.nvme_path", "/c")]


def test_the_json_is_kept_read_only_and_not_compared():
    config = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 1}}
    spec = parse_strategy({"_target_": OURS, "config": config})
    assert spec.json_optimizer
    config["zero_optimization"]["stage"] = 3  # the caller's dict changing later does not change the spec
    assert spec.config is not None
    assert spec.config["zero_optimization"]["stage"] == 1
    with pytest.raises(TypeError):
        spec.config["x"] = 1  # type: ignore[index]


def test_a_built_strategy_carries_its_spec_and_a_foreign_one_is_read_from_its_config():
    assert spec_of(TrainOptFSDPStrategy(cpu_offload=True)).offload == {"optimizer": "cpu", "param": "cpu"}

    class Foreign:
        config = {"zero_optimization": {"stage": 2, "cpu_offload": True}}  # DeepSpeed's deprecated boolean

    assert spec_of(Foreign()).offload == {"optimizer": "cpu", "param": "none"}
    assert spec_of(object()).offload == {"optimizer": "none", "param": "none"}


BAD = [
    # (node, key, value): a preset's keyword arguments, then a user's JSON
    ({"_target_": OURS, "stage": 5}, "strategy.stage", 5),
    ({"_target_": OURS, "stage": True}, "strategy.stage", True),
    ({"_target_": OURS, "offload_optimizer_device": "gpu"}, "strategy.offload_optimizer_device", "gpu"),
    ({"_target_": OURS, "sub_group_size": -1}, "strategy.sub_group_size", -1),
    ({"_target_": OURS, "reduce_bucket_size": "big"}, "strategy.reduce_bucket_size", "big"),
    ({"_target_": OURS, "allgather_bucket_size": 0.5}, "strategy.allgather_bucket_size", 0.5),
    ({"_target_": OURS, "param_persistence_threshold": -2}, "strategy.param_persistence_threshold", -2),
    ({"_target_": OURS, "params_buffer_size": 0}, "strategy.params_buffer_size", 0),
    ({"_target_": OURS, "config": "???"}, "strategy.config", "???"),
    ({"_target_": OURS, "config": 3}, "strategy.config", 3),
    ({"_target_": OURS, "config": {"zero_optimization": "x"}}, "strategy.config.zero_optimization", "x"),
    ({"_target_": OURS, "config": {"zero_optimization": {"stage": 4}}}, "strategy.config.zero_optimization.stage", 4),
    (
        {"_target_": OURS, "config": {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}}},
        "strategy.config.zero_optimization.stage3_max_live_parameters",
        -1,
    ),
    (
        {"_target_": OURS, "config": {"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}},
        "strategy.config.zero_optimization.offload_param.device",
        "disk",
    ),
    (
        {"_target_": OURS, "config": {"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 2}}}},
        "strategy.config.zero_optimization.offload_optimizer.ratio",
        2,
    ),
    ({"_target_": "no.such.Strategy"}, "strategy._target_", "no.such.Strategy"),
    ({"name": "zero9"}, "strategy._target_", None),
]


@pytest.mark.parametrize(("node", "key", "value"), BAD)
def test_a_bad_value_is_refused_naming_the_key_the_value_and_the_fix(node, key, value):
    with pytest.raises(ConfigError) as err:
        parse_strategy(node)
    assert (err.value.key, err.value.value) == (key, value)
    assert str(err.value) == f"{key}={value!r} is invalid: {err.value.fix}"
    assert err.value.fix.endswith(".")
    assert len(err.value.fix) > 20
