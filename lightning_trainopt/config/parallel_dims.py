"""The run's :class:`ParallelDims` from the composed config, validated before anything is built or spawned."""

from __future__ import annotations

from typing import Any

import torch

from lightning_trainopt.parallel.dims import ParallelDims

__all__ = ["parallel_dims_from_cfg", "parallel_dims_of", "resolved_devices"]

# Lightning's own ModelParallelStrategy defaults both sizes to "auto" (tensor parallel within a node, data parallel
# across nodes); our TrainOptFSDPStrategy (FSDP2 on a ModelParallelStrategy) defaults tensor_parallel_size to 1.
_LIGHTNING_MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"


def resolved_devices(trainer: Any) -> int | None:
    """Processes per node from the ``trainer`` node's ``devices``; ``None`` if it cannot be known from the config.

    ``devices=auto``/``-1`` count the CUDA devices when the run uses them, else one CPU process; a list counts its
    entries.
    """
    devices = trainer.get("devices", "auto")
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, (int, str)):  # a list of device indices (list or ListConfig)
        devices = len(devices)
    if devices in ("auto", -1, "-1"):
        on_cpu = str(trainer.get("accelerator", "auto")) == "cpu" or not torch.cuda.is_available()
        devices = 1 if on_cpu else torch.cuda.device_count()
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        return None
    return devices


def parallel_dims_from_cfg(cfg: Any) -> ParallelDims | None:
    """The run's dims from ``trainer.devices`` x ``trainer.num_nodes`` and the strategy node's
    ``tensor_parallel_size``/``data_parallel_size``/``replicate`` (``auto`` as Lightning reads them); ``None`` when
    the device count is not known from the config (e.g. ``devices=auto`` on a machine other than the one that trains).

    Raises:
        ConfigError: a size that is not a positive whole number.
        IncompatibleConfigError: the devices are not divisible by the tensor-parallel size, or the sizes' product is
            not the world size (the message names ``trainer.devices``, ``num_nodes`` and the fix).
    """
    trainer = cfg.trainer
    devices = resolved_devices(trainer)
    nodes = trainer.get("num_nodes", 1)
    if devices is None or not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        return None
    return parallel_dims_of(devices, nodes, cfg.get("strategy"))


def parallel_dims_of(devices: int, num_nodes: int, strategy: Any) -> ParallelDims:
    """The dims of ``devices`` x ``num_nodes`` ranks under the ``strategy`` node (``None``: Lightning's default).

    Raises:
        ConfigError: a size that is not a positive whole number.
        IncompatibleConfigError: the sizes do not split the world (see :meth:`ParallelDims.from_config`).
    """
    if not hasattr(strategy, "get"):  # no node, or a Lightning strategy name such as "ddp": every rank a replica
        strategy = {}
    lightning_default = str(strategy.get("_target_", "")) == _LIGHTNING_MODEL_PARALLEL
    tp = strategy.get("tensor_parallel_size", "auto" if lightning_default else 1)
    dp = strategy.get("data_parallel_size", "auto")
    if tp == "auto":
        tp = devices
    if dp == "auto":
        dp = num_nodes if lightning_default else -1
    # TrainOptTPStrategy (+strategy=fsdp_tp): `replicate` data-parallel replicas of shards (HSDP).
    replicate = strategy.get("replicate", 1)
    return ParallelDims.from_config(devices, num_nodes, tp=tp, dp_replicate=replicate, dp_shard=dp)
