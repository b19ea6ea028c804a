"""plan.py with ``+strategy=deepspeed_json strategy.config=FILE``: the layout and accumulation come from the JSON."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_trainopt.config.plan import plan
from lightning_trainopt.config.plan_inputs import load_preset, strategy_layout
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.parallel import load_deepspeed_json
from lightning_trainopt.parallel.deepspeed import TrainOptDeepSpeedStrategy
from tests.helpers.compose import REPO_ROOT, compose_config

# The strategy classes a node names (its `_target_` is imported to read the class's kind and defaults).
OURS = "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy"
LIGHTNINGS = "lightning.pytorch.strategies.DeepSpeedStrategy"
# A user's file: ZeRO-3, optimizer and parameters on the CPU, 32 sequences per optimizer step.
DS3 = {
    "train_batch_size": 32,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "reduce_bucket_size": 5e8,
    },
    "bf16": {"enabled": True},
}
BASE = [
    "model=llama_7b",
    "hardware=a100_80gb",
    "trainer.devices=4",
    "+strategy=deepspeed_json",
    "precision=bf16",
    "data.seq_len=2048",
    "data.batch_size=2",
]


def _plan(tmp_path, ds: dict, *extra: str):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return plan(compose_config([*BASE, f"strategy.config={path}", *extra], tmp_path, name="plan"))


def test_the_issue_json_plans_zero3_with_cpu_offload_and_accumulation_4(tmp_path):
    result = _plan(tmp_path, DS3)
    i = result.estimate.inputs
    assert (i.layout.kind, i.layout.zero_stage) == ("deepspeed", 3)
    assert (i.layout.offload_optimizer, i.layout.offload_params) == ("cpu", "cpu")
    assert i.layout.reduce_bucket_size == 500_000_000
    assert i.accumulate == 4  # 32 / (2 x 4)
    d = result.to_dict()
    assert d["memory_breakdown"]["optimizer_states"]["device"] == 0
    assert d["memory_breakdown"]["optimizer_states"]["cpu"] > 0
    assert d["memory_breakdown"]["params"]["cpu"] > d["memory_breakdown"]["params"]["device"]
    assert "trainer.accumulate_grad_batches=4" in result.command


def test_the_printed_command_reproduces_the_planned_run(tmp_path):
    result = _plan(tmp_path, DS3)
    i = result.estimate.inputs
    train_cfg = compose_config(result.command.split()[2:], tmp_path, name="train")
    t = train_cfg.trainer
    world = t.devices * t.get("num_nodes", 1)
    assert strategy_layout(train_cfg.strategy, world) == i.layout
    # What TrainOptDeepSpeedStrategy derives at set-up from the same JSON and Trainer values.
    ds = load_deepspeed_json(train_cfg.strategy.config)
    derived = TrainOptDeepSpeedStrategy.accumulation_for_train_batch_size(
        ds["train_batch_size"], train_cfg.data.batch_size, world, t.accumulate_grad_batches
    )
    assert derived == t.accumulate_grad_batches == i.accumulate
    assert (train_cfg.data.batch_size, train_cfg.data.seq_len) == (i.micro_batch, i.seq_len)


def test_a_json_equal_to_a_preset_plans_the_same_bytes(tmp_path):
    preset = load_preset(REPO_ROOT / "lightning_trainopt" / "conf", "strategy", "zero3_offload")
    ds = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
            "reduce_bucket_size": preset.reduce_bucket_size,
            "stage3_param_persistence_threshold": preset.param_persistence_threshold,
            "overlap_comm": True,
            "sub_group_size": 1e12,  # Lightning's default; DeepSpeed's own is 1e9
        }
    }
    from_json = _plan(tmp_path, ds)
    over = [o for o in BASE if not o.startswith("+strategy")] + ["+strategy=zero3_offload"]
    from_preset = plan(compose_config(over, tmp_path, name="plan"))
    assert from_json.estimate.inputs.layout == replace(from_preset.estimate.inputs.layout, name="deepspeed_json")
    assert from_json.estimate.peak_device_bytes == from_preset.estimate.peak_device_bytes


def test_deepspeed_defaults_apply_to_what_the_json_leaves_out():
    layout = strategy_layout({"_target_": OURS, "config": {"zero_optimization": {"stage": 2}}}, 4)
    # DeepSpeed's own defaults (runtime/zero/config.py), not Lightning's keyword defaults (2e8, overlap_comm=True).
    assert layout.zero_stage == 2
    assert layout.reduce_bucket_size == 500_000_000
    assert layout.overlap_comm is False
    assert layout.contiguous_gradients is True
    assert (layout.offload_optimizer, layout.offload_params) == ("none", "none")


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        ({"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}, ("nvme", "nvme")),
        ({"stage": 2, "cpu_offload": True}, ("cpu", "none")),  # DeepSpeed's deprecated boolean
        ({"stage": 3, "offload_param": {"device": "cpu"}}, ("none", "cpu")),
    ],
)
def test_offload_devices_are_read_from_the_json(zero, expected):
    layout = strategy_layout({"_target_": OURS, "config": {"zero_optimization": zero}}, 2)
    assert (layout.offload_optimizer, layout.offload_params) == expected


def test_stage3_knobs_are_read_by_name_or_alias():
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 1234,
        "stage3_prefetch_bucket_size": 7e6,
        "max_live_parameters": 100,
        "stage3_max_reuse_distance": 5,
    }
    layout = strategy_layout({"_target_": LIGHTNINGS, "config": {"zero_optimization": zero}}, 2)
    assert (layout.param_persistence_threshold, layout.prefetch_bucket_size) == (1234, 7_000_000)
    assert (layout.max_live_parameters, layout.max_reuse_distance) == (100, 5)
    assert layout.overlap_comm is True  # DeepSpeed's stage-3 default


def test_infinity_buffer_knobs_are_read_from_the_json_with_deepspeed_defaults():
    zero = {
        "stage": 3,
        "sub_group_size": 5e8,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 6},
        "offload_param": {"device": "nvme", "buffer_count": 3, "buffer_size": 2e7, "max_in_cpu": 0},
    }
    layout = strategy_layout({"_target_": LIGHTNINGS, "config": {"zero_optimization": zero}}, 2)
    assert (layout.sub_group_size, layout.optimizer_buffer_count) == (500_000_000, 6)
    assert (layout.params_buffer_count, layout.params_buffer_size, layout.max_in_cpu) == (3, 20_000_000, 0)
    bare = strategy_layout({"_target_": LIGHTNINGS, "config": {"zero_optimization": {"stage": 3}}}, 2)
    assert bare.sub_group_size == 1_000_000_000  # DeepSpeed's default, not Lightning's 1e12
    assert (bare.optimizer_buffer_count, bare.params_buffer_count, bare.params_buffer_size) == (4, 5, 100_000_000)
    assert bare.max_in_cpu == 1_000_000_000


def test_infinity_buffer_knobs_are_read_from_a_preset_node():
    node = {
        "_target_": "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy",
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
        "offload_optimizer_device": "nvme",
        "offload_params_device": "nvme",
        "optimizer_buffer_count": 8,
        "params_buffer_count": 2,
        "params_buffer_size": 1e6,
        "max_in_cpu": 0,
        "sub_group_size": 1e9,
    }
    layout = strategy_layout(node, 2)
    assert (layout.optimizer_buffer_count, layout.params_buffer_count, layout.params_buffer_size) == (8, 2, 10**6)
    assert (layout.max_in_cpu, layout.sub_group_size) == (0, 10**9)
    # Lightning's defaults when the preset leaves them out (conf/strategy/zero_infinity.yaml does).
    preset = strategy_layout(load_preset(REPO_ROOT / "lightning_trainopt" / "conf", "strategy", "zero_infinity"), 8)
    assert (preset.optimizer_buffer_count, preset.params_buffer_count, preset.params_buffer_size) == (4, 5, 10**8)
    assert (preset.max_in_cpu, preset.sub_group_size) == (10**9, 10**12)


@pytest.mark.parametrize(
    ("node", "key"),
    [
        (
            {"config": {"zero_optimization": {"stage": 3, "offload_optimizer": {"buffer_count": 0}}}},
            "offload_optimizer.buffer_count",
        ),
        (
            {"config": {"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": 1.5}}}},
            "offload_param.buffer_size",
        ),
        (
            {"config": {"zero_optimization": {"stage": 3, "offload_param": {"max_in_cpu": -1}}}},
            "offload_param.max_in_cpu",
        ),
        ({"config": {"zero_optimization": {"stage": 3, "sub_group_size": "big"}}}, "zero_optimization.sub_group_size"),
        ({"stage": 3, "params_buffer_count": 0}, "strategy.params_buffer_count"),
        ({"stage": 3, "max_in_cpu": -5}, "strategy.max_in_cpu"),
        ({"stage": 3, "optimizer_buffer_count": 2.5}, "strategy.optimizer_buffer_count"),
    ],
)
def test_bad_infinity_buffer_knobs_are_refused_with_the_key(node, key):
    with pytest.raises(ConfigError, match=key):
        strategy_layout({"_target_": OURS, **node}, 2)


_NVME = {"device": "nvme", "nvme_path": "/tmp"}


@pytest.mark.parametrize(
    ("node", "key"),
    [
        (
            {"config": {"zero_optimization": {"stage": 3, "offload_optimizer": {**_NVME, "buffer_count": 3}}}},
            "strategy.config.zero_optimization.offload_optimizer.buffer_count",
        ),
        (
            {"stage": 3, "offload_optimizer": True, "offload_optimizer_device": "nvme", "optimizer_buffer_count": 3},
            "strategy.optimizer_buffer_count",
        ),
    ],
)
def test_fewer_optimizer_swap_buffers_than_adam_takes_are_refused(node, key):
    # DeepSpeed's swap_in_optimizer_state takes 4 pinned buffers at once (fp32 weights, 2 moments, gradient); with 3
    # the first optimizer step fails on an assertion, after a whole forward and backward.
    with pytest.raises(ConfigError, match="swaps 4 tensors") as err:
        strategy_layout({"_target_": OURS, **node}, 2)
    assert err.value.key == key
    # CPU offload has no swap buffers: the count is not used, so 3 passes there.
    cpu = {"stage": 3, "offload_optimizer": True, "offload_optimizer_device": "cpu", "optimizer_buffer_count": 3}
    assert strategy_layout({"_target_": OURS, **cpu}, 2).offload_optimizer == "cpu"


@pytest.mark.parametrize(
    ("ds", "extra", "error", "key"),
    [
        ({**DS3, "train_batch_size": 30}, [], ConfigError, "strategy.config.train_batch_size"),
        (DS3, ["trainer.accumulate_grad_batches=2"], ConfigError, "trainer.accumulate_grad_batches"),
        ({**DS3, "gradient_accumulation_steps": 4}, [], ConfigError, "strategy.config.gradient_accumulation_steps"),
        ({"bf16": {"enabled": True}}, [], ConfigError, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}}, [], ConfigError, "reduce_bucket_size"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, [], ConfigError, "offload_param"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
            [],
            ConfigError,
            "ratio",
        ),
        (DS3, ["precision=fp32"], IncompatibleConfigError, "strategy.config.bf16.enabled"),
    ],
)
def test_a_json_train_py_refuses_is_refused(tmp_path, ds, extra, error, key):
    with pytest.raises(error, match=key):
        _plan(tmp_path, ds, *extra)


def test_the_missing_json_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match="strategy.config"):
        plan(compose_config(BASE, tmp_path, name="plan"))
    with pytest.raises(ConfigError, match="strategy.config"):
        plan(compose_config([*BASE, "strategy.config=/nonexistent/ds.json"], tmp_path, name="plan"))
