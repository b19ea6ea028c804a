"""ParallelDims, strategy classes, the spec of a strategy node, and the mapping of ``conf/strategy`` presets into their
arguments (``config/strategy.py`` instantiates them)."""

from lightning_trainopt.checkpoint.io import AtomicCheckpointIO
from lightning_trainopt.parallel.builder import preset_name, strategy_info, strategy_kwargs
from lightning_trainopt.parallel.ddp import DimsSampling, TrainOptDDPStrategy
from lightning_trainopt.parallel.deepspeed import TrainOptDeepSpeedStrategy, to_deepspeed_cpu_adam
from lightning_trainopt.parallel.deepspeed_json import load_deepspeed_json
from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.fsdp import TrainOptFSDPStrategy, apply_fully_shard
from lightning_trainopt.parallel.spec import (
    StrategySpec,
    ZeroSpec,
    parse_strategy,
    precision_needs,
    spec_of,
    with_spec,
)
from lightning_trainopt.parallel.tp_strategy import TrainOptTPStrategy

__all__ = [
    "AtomicCheckpointIO",
    "DimsSampling",
    "ParallelDims",
    "StrategySpec",
    "TrainOptDDPStrategy",
    "TrainOptDeepSpeedStrategy",
    "TrainOptFSDPStrategy",
    "TrainOptTPStrategy",
    "ZeroSpec",
    "apply_fully_shard",
    "load_deepspeed_json",
    "parse_strategy",
    "precision_needs",
    "preset_name",
    "spec_of",
    "strategy_info",
    "strategy_kwargs",
    "to_deepspeed_cpu_adam",
    "with_spec",
]
