"""ParallelDims, strategy classes, the spec of a strategy node, and the builder of ``conf/strategy`` presets."""

from lightning_trainopt.checkpoint.io import AtomicCheckpointIO
from lightning_trainopt.parallel.builder import build_strategy, preset_name, strategy_info
from lightning_trainopt.parallel.deepspeed import TrainOptDeepSpeedStrategy, to_deepspeed_cpu_adam
from lightning_trainopt.parallel.deepspeed_json import load_deepspeed_json
from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.fsdp import TrainOptFSDPStrategy, apply_fully_shard
from lightning_trainopt.parallel.spec import StrategySpec, ZeroSpec, parse_strategy, spec_of

__all__ = [
    "AtomicCheckpointIO",
    "ParallelDims",
    "StrategySpec",
    "TrainOptDeepSpeedStrategy",
    "TrainOptFSDPStrategy",
    "ZeroSpec",
    "apply_fully_shard",
    "build_strategy",
    "load_deepspeed_json",
    "parse_strategy",
    "preset_name",
    "spec_of",
    "strategy_info",
    "to_deepspeed_cpu_adam",
]
