"""Measured bytes of an optimizer's state, per parameter, split into quantised and full-precision states."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_trainopt.metrics.memory_accounting import tensor_leaves

__all__ = ["OptimizerStateReport", "optimizer_state_bytes"]

_QUANTISED_DTYPES = {torch.uint8, torch.int8}


@dataclass(frozen=True)
class OptimizerStateReport:
    """What an optimizer really keeps (read from ``optimizer.state`` after at least one step).

    Args:
        state_bytes: unique storage bytes of all state tensors (shared buffers such as quantisation maps once).
        n_params: parameter elements of the optimizer's groups.
        quantised_params: elements whose state is 8-/4-bit (int8/uint8 codes or a torchao low-bit tensor).
        full_params: elements whose state is kept in full precision (e.g. below bitsandbytes' ``min_8bit_size``).
        quantised_bytes: state bytes of the quantised parameters (codes, scales, per-tensor maps).
        full_bytes: state bytes of the full-precision ones.
        by_dtype: ``state_bytes`` by dtype name.
    """

    state_bytes: int
    n_params: int
    quantised_params: int
    full_params: int
    quantised_bytes: int
    full_bytes: int
    by_dtype: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.n_params if self.n_params else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe dict (for metrics.json)."""
        return {
            "state_bytes": self.state_bytes,
            "n_params": self.n_params,
            "bytes_per_param": self.bytes_per_param,
            "quantised_params": self.quantised_params,
            "full_params": self.full_params,
            "quantised_bytes_per_param": self.quantised_bytes / self.quantised_params
            if self.quantised_params
            else None,
            "full_bytes_per_param": self.full_bytes / self.full_params if self.full_params else None,
            "by_dtype": dict(self.by_dtype),
        }


def _key(t: torch.Tensor) -> tuple[str, int, int]:
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr() or id(storage), storage.nbytes()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> OptimizerStateReport:
    """Measure ``optimizer``'s state; call it after a step (most optimizers create state lazily).

    A bitsandbytes parameter with a ``state1`` of dtype uint8 counts as quantised, as does a torchao
    low-bit state tensor; scalars such as ``step`` count with their parameter.
    """
    seen: set[tuple[str, int]] = set()
    by_dtype: dict[str, int] = {}
    n_params = q_params = f_params = q_bytes = f_bytes = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            n_params += p.numel()
            state = optimizer.state.get(p, {})
            own = 0
            quantised = False
            for value in state.values():
                if not isinstance(value, torch.Tensor):
                    continue
                leaves = list(tensor_leaves(value))
                if len(leaves) > 1 or type(value) is not torch.Tensor or value.dtype in _QUANTISED_DTYPES:
                    quantised = quantised or value.numel() > 1
                for leaf in leaves:
                    device, ptr, nbytes = _key(leaf)
                    if (device, ptr) in seen:
                        continue
                    seen.add((device, ptr))
                    own += nbytes
                    dtype = str(leaf.dtype).removeprefix("torch.")
                    by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
            if not state:
                continue
            if quantised:
                q_params += p.numel()
                q_bytes += own
            else:
                f_params += p.numel()
                f_bytes += own
    return OptimizerStateReport(
        state_bytes=q_bytes + f_bytes,
        n_params=n_params,
        quantised_params=q_params,
        full_params=f_params,
        quantised_bytes=q_bytes,
        full_bytes=f_bytes,
        by_dtype=by_dtype,
    )
