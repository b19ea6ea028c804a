"""Bytes of optimizer state per parameter tensor, as each optimizer implementation allocates it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_trainopt.exceptions import ConfigError

__all__ = ["OPTIMIZER_STATES", "OptimizerStateModel", "optimizer_state_model"]


@dataclass(frozen=True)
class OptimizerStateModel:
    """How one optimizer stores its state.

    Args:
        name: short name shown in derivations.
        n_states: moment tensors per parameter (Adam 2, Lion / SGD-momentum 1, plain SGD 0).
        bits: 32 for full-precision states, 8 or 4 for block-quantised states.
        state_dtype_bytes: bytes per element of full-precision states; ``None`` means the parameter's dtype
            (torch optimizers use ``zeros_like(param)``).
        min_quant_numel: tensors smaller than this keep full-precision states (bitsandbytes and torchao: 4096).
        small_state_bytes: bytes per element of those small tensors' states (``None``: the parameter's dtype).
        block_size: elements per quantisation block; each block stores one fp32 scale per state.
        step_bytes: bytes of the per-tensor ``step`` counter (torch keeps a float32 scalar tensor).
        whole_blocks_only: quantise only tensors whose size is a multiple of ``block_size`` (torchao's
            ``_new_buffer``); others keep full-precision states.
    """

    name: str
    n_states: int = 2
    bits: int = 32
    state_dtype_bytes: int | None = None
    min_quant_numel: int = 0
    small_state_bytes: int | None = None
    block_size: int = 0
    step_bytes: int = 4
    whole_blocks_only: bool = False

    def formula(self, dtype_bytes: int) -> str:
        """Bytes per element in words, for derivations."""
        if self.bits == 32:
            return f"{self.n_states} x {self.state_dtype_bytes or dtype_bytes} B"
        return f"{self.n_states} x {self.bits / 8:g} B (+ fp32 scale per {self.block_size})"

    def bytes_for(self, numels: Iterable[int], dtype_bytes: int) -> int:
        """State bytes for parameter tensors of ``numels`` elements whose dtype has ``dtype_bytes`` bytes."""
        total = 0
        for n in numels:
            if n <= 0:
                continue
            total += self.step_bytes
            if self.bits == 32:
                total += self.n_states * n * (self.state_dtype_bytes or dtype_bytes)
            elif n < self.min_quant_numel or (self.whole_blocks_only and n % self.block_size):
                total += self.n_states * n * (self.small_state_bytes or dtype_bytes)
            else:
                codes = math.ceil(n * self.bits / 8)
                scales = 4 * math.ceil(n / self.block_size)
                total += self.n_states * (codes + scales)
        return total


# Read from each implementation: torch/optim/adamw.py (zeros_like(p) moments + float32 `step` tensor);
# bitsandbytes/optim/optimizer.py Optimizer8bit.init_state (uint8 codes, fp32 absmax per 256 block, fp32 states
# below min_8bit_size=4096, `step` an int); torchao/optim/subclass_8bit.py / subclass_4bit.py (block 256 / 128,
# fp32 scales; params below 4096 elements or not a multiple of the block keep states in their own dtype, adam.py
# _new_buffer); deepspeed/ops/adam/cpu_adam.py (fp32).
OPTIMIZER_STATES: dict[str, OptimizerStateModel] = {
    "adamw": OptimizerStateModel("adamw"),
    "adam": OptimizerStateModel("adam"),
    "sgd": OptimizerStateModel("sgd-momentum", n_states=1),
    "lion": OptimizerStateModel("lion", n_states=1),
    "deepspeed_cpu_adam": OptimizerStateModel("DeepSpeedCPUAdam", state_dtype_bytes=4, step_bytes=0),
    "adamw8bit": OptimizerStateModel(
        "bnb AdamW8bit", bits=8, min_quant_numel=4096, small_state_bytes=4, block_size=256, step_bytes=0
    ),
    "lion8bit": OptimizerStateModel(
        "bnb Lion8bit", n_states=1, bits=8, min_quant_numel=4096, small_state_bytes=4, block_size=256, step_bytes=0
    ),
    "adamw8bit_torchao": OptimizerStateModel(
        "torchao AdamW8bit", bits=8, min_quant_numel=4096, block_size=256, whole_blocks_only=True
    ),
    "adamw4bit_torchao": OptimizerStateModel(
        "torchao AdamW4bit", bits=4, min_quant_numel=4096, block_size=128, whole_blocks_only=True
    ),
}


def optimizer_state_model(target: str, name: str | None = None) -> OptimizerStateModel:
    """Pick the state model of an optimizer from its Hydra ``_target_`` (or a preset name).

    Args:
        target: the optimizer's import path, e.g. ``bitsandbytes.optim.AdamW8bit``, or a key of
            :data:`OPTIMIZER_STATES`.
        name: the optimizer preset name, used only in the error message.

    Raises:
        ConfigError: the optimizer is not one the planner knows.
    """
    if target in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[target]
    t = target.lower()
    leaf = t.rsplit(".", 1)[-1]
    if "bitsandbytes" in t or "bnb" in t:
        key = "lion8bit" if "lion" in leaf else "adamw8bit"
    elif "torchao" in t:
        key = "adamw4bit_torchao" if "4bit" in leaf else "adamw8bit_torchao"
    elif "cpuadam" in leaf:
        key = "deepspeed_cpu_adam"
    elif leaf in ("adam", "adamw", "fusedadam", "nadam", "radam"):
        key = "adamw"
    elif leaf == "sgd":
        key = "sgd"
    elif "lion" in leaf:
        key = "lion"
    else:
        raise ConfigError(
            "optimizer._target_",
            name or target,
            f"the planner knows {', '.join(sorted(OPTIMIZER_STATES))}; use one of them or plan with optimizer=adamw.",
        )
    return OPTIMIZER_STATES[key]
