"""Each private DeepSpeed attribute ``_compat/deepspeed_internals.py`` wraps is still there, in the shape it expects."""

from __future__ import annotations

import inspect

import pytest

from lightning_trainopt._compat import deepspeed_internals as di
from lightning_trainopt._compat._guard import UpstreamChangedError
from tests.unit.compat._upstream import params, require, require_in_range

pytest.importorskip("deepspeed")

RANGE = di.DEEPSPEED_RANGE


def _require(condition: bool, what: str) -> None:
    require(condition, "deepspeed", what, RANGE, "deepspeed_internals")


def test_installed_deepspeed_is_in_the_range_written_for():
    require_in_range("deepspeed", RANGE, "deepspeed_internals")


def test_zero3_counters_are_reset(monkeypatch):
    from deepspeed.runtime.zero import parameter_offload, partition_parameters

    count = inspect.signature(parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module).parameters["count"]
    before = count.default[0]
    count.default[0] = 30  # as the first ZeRO-3 job of a sweep leaves it
    monkeypatch.setattr(partition_parameters.Init, "param_id", 12)
    monkeypatch.setattr(partition_parameters.Init, "num_persisted_parameters", 3)
    try:
        di.reset_zero3_counters()
        assert count.default == [0]
    finally:
        count.default[0] = before
    assert partition_parameters.Init.param_id == 0
    assert partition_parameters.Init.num_persisted_parameters == 0


def test_a_counter_that_moved_is_named(monkeypatch):
    from deepspeed.runtime.zero import parameter_offload

    monkeypatch.setattr(parameter_offload.DeepSpeedZeRoOffload, "_register_deepspeed_module", lambda self, module: 0)
    with pytest.raises(UpstreamChangedError, match=r"deepspeed .*_register_deepspeed_module\(count=\[0\]\)"):
        di.reset_zero3_counters()


def test_engine_checkpoint_name():
    from deepspeed.runtime.engine import DeepSpeedEngine

    method = getattr(DeepSpeedEngine, "_get_zero_ckpt_name", None)
    _require(callable(method) and params(method) == ["checkpoints_path", "tag"], "DeepSpeedEngine._get_zero_ckpt_name")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_set_fp32_optimizer_param_groups", []),
        ("_clear_fp32_optimizer_param_groups", []),
        ("_swappable_optimizer_subgroup", ["sub_group_id"]),
    ],
)
def test_zero3_optimizer_methods(name, expected):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    method = getattr(DeepSpeedZeroOptimizer_Stage3, name, None)
    _require(callable(method) and params(method) == expected, f"DeepSpeedZeroOptimizer_Stage3.{name}")


def test_zero3_optimizer_refresh_is_there():
    # Decorated by DeepSpeed's instrumentation (*args, **kwargs): its presence is what can be checked.
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    _require(
        callable(getattr(DeepSpeedZeroOptimizer_Stage3, "_reassign_or_swap_out_partitioned_parameters", None)),
        "DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters",
    )


def test_fp32_groups_are_cleared_even_when_the_block_raises():
    calls = []

    class Optimizer:
        def _set_fp32_optimizer_param_groups(self) -> None:
            calls.append("set")

        def _clear_fp32_optimizer_param_groups(self) -> None:
            calls.append("clear")

    with pytest.raises(KeyError), di.fp32_param_groups_set(Optimizer()):
        raise KeyError("x")
    assert calls == ["set", "clear"]
