"""Every private attribute of DeepSpeed that the package touches.

Written against deepspeed >=0.16,<0.20 (:data:`DEEPSPEED_RANGE`); ``tests/unit/compat/test_deepspeed_internals.py``
fails naming the change when an upgrade renames or reshapes one of them. DeepSpeed is imported inside each function:
it is an optional dependency.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_trainopt._compat._guard import changed, private_attr

__all__ = [
    "DEEPSPEED_RANGE",
    "fp32_param_groups_set",
    "refresh_partitioned_parameters",
    "reset_zero3_counters",
    "swappable_subgroup",
    "zero_checkpoint_name",
]

#: The deepspeed versions these wrappers were written and tested against: ``[low, high)``.
DEEPSPEED_RANGE = ("0.16", "0.20")
_MODULE = "deepspeed_internals"


def _method(owner: Any, name: str) -> Any:
    return private_attr(owner, name, "deepspeed", *DEEPSPEED_RANGE, _MODULE)


def reset_zero3_counters() -> None:
    """Reset the process-wide counters ZeRO-3 numbers modules and parameters with.

    ``DeepSpeedZeRoOffload._register_deepspeed_module`` numbers modules (``ds_id``) from a mutable default argument
    (``count=[0]``), and ``zero.Init`` numbers parameters and counts persisted ones in class attributes. A Hydra sweep
    runs its jobs in one rank-0 process but starts fresh processes for the other ranks, so without this the second
    ZeRO-3 job of a sweep fails in its first step: "Detected a disagreement on list contents between rank0 and rank1
    ... rank0: [30] rank1: [0]" (the module order check of ``PartitionedParameterCoordinator.reset_step``).

    Raises:
        UpstreamChangedError: the counter is no longer a ``count=[0]`` default argument.
    """
    from deepspeed.runtime.zero import parameter_offload, partition_parameters

    register = _method(parameter_offload.DeepSpeedZeRoOffload, "_register_deepspeed_module")
    count = inspect.signature(register).parameters.get("count")
    if count is None or not (isinstance(count.default, list) and len(count.default) == 1):
        raise changed(
            "deepspeed", "DeepSpeedZeRoOffload._register_deepspeed_module(count=[0])", *DEEPSPEED_RANGE, _MODULE
        )
    count.default[0] = 0
    for name in ("param_id", "num_persisted_parameters", "num_persisted_elements"):
        if isinstance(getattr(partition_parameters.Init, name, None), int):
            setattr(partition_parameters.Init, name, 0)


def zero_checkpoint_name(engine: Any, checkpoint_dir: str, tag: str) -> str:
    """The path of this rank's ZeRO optimizer-state file in a checkpoint (``engine._get_zero_ckpt_name``)."""
    return str(_method(engine, "_get_zero_ckpt_name")(checkpoint_dir, tag))


@contextmanager
def fp32_param_groups_set(zero_optimizer: Any) -> Iterator[None]:
    """Inside the block, the inner optimizer's param groups hold the fp32 partitions (ZeRO-3's (de)serialisation)."""
    set_groups = _method(zero_optimizer, "_set_fp32_optimizer_param_groups")
    clear_groups = _method(zero_optimizer, "_clear_fp32_optimizer_param_groups")
    set_groups()
    try:
        yield
    finally:
        clear_groups()


def swappable_subgroup(zero_optimizer: Any, index: int) -> bool:
    """ZeRO-3 keeps sub-group ``index``'s fp32 master on NVMe (else in memory: too small to swap)."""
    return bool(_method(zero_optimizer, "_swappable_optimizer_subgroup")(index))


def refresh_partitioned_parameters(zero_optimizer: Any, index: int) -> None:
    """Copy sub-group ``index``'s fp32 master into its working partitions (and swap them out where they live there)."""
    _method(zero_optimizer, "_reassign_or_swap_out_partitioned_parameters")(index)
