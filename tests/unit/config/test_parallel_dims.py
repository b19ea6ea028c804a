"""The run's ParallelDims from the composed config: the strategy node's sizes, resolved device counts."""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.config.parallel_dims import parallel_dims_from_cfg, resolved_devices
from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.parallel import ParallelDims


def test_dims_from_the_config_read_the_strategy_node():
    def cfg(devices: Any, strategy: dict | str | None = None, nodes: int = 1) -> Any:
        trainer = {"accelerator": "cpu", "devices": devices, "num_nodes": nodes}
        return OmegaConf.create({"trainer": trainer, "strategy": strategy})

    assert parallel_dims_from_cfg(cfg(4)) == ParallelDims.from_world(4)
    assert parallel_dims_from_cfg(cfg(4, {"tensor_parallel_size": 2})) == ParallelDims.from_world(4, tp=2)
    lightning_mp = {"_target_": "lightning.pytorch.strategies.ModelParallelStrategy"}
    auto = parallel_dims_from_cfg(cfg(4, lightning_mp, nodes=2))  # Lightning's auto: tp within a node, dp across
    assert auto is not None
    assert (auto.dp, auto.tp) == (2, 4)
    with pytest.raises(IncompatibleConfigError, match="trainer.devices=3 x num_nodes=1 is not divisible by tp=2"):
        parallel_dims_from_cfg(cfg(3, {"tensor_parallel_size": 2}))
    assert parallel_dims_from_cfg(cfg(2, "ddp")) == ParallelDims.from_world(2)  # a Lightning strategy name
    assert parallel_dims_from_cfg(cfg(0)) is None  # unknown from the config: validated once the Trainer runs


def test_devices_resolved_from_the_trainer_node():
    assert resolved_devices({"devices": 4, "num_nodes": 2}) == 4
    assert resolved_devices(OmegaConf.create({"devices": [0, 1]})) == 2
    assert resolved_devices({"devices": "auto", "accelerator": "cpu"}) == 1
    assert resolved_devices({"devices": "3"}) == 3
    assert resolved_devices({"devices": 0}) is None
