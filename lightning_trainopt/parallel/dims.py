"""ParallelDims: how the world's ranks split into data-parallel replicas and tensor-parallel groups.

The only source of data-parallel size and rank: the sampler's ``num_replicas``/``rank``, tokens/s, MFU, dollars per
token, the global batch, the micro-batch finder, the planner and metrics.json all read it, so a run whose ranks
share a replica (tensor parallelism) never counts a replica's tokens once per rank.

Ranks are laid out as torchtitan lays its mesh out, ``[pp, dp_replicate, dp_shard, cp, tp]`` with ``tp`` innermost:
the ``tp`` consecutive ranks of one group hold one replica and read the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError

__all__ = ["ParallelDims"]

# Names a device mesh may give its dimensions: Lightning's ModelParallelStrategy ("data_parallel" shards the
# parameters FSDP2-style, "tensor_parallel"), and torchtitan's.
_MESH_DIMS = {
    "data_parallel": "dp_shard",
    "dp_shard": "dp_shard",
    "dp_replicate": "dp_replicate",
    "tensor_parallel": "tp",
    "tp": "tp",
}


def _check_size(key: str, value: Any, allow_infer: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (allow_infer and value == -1)):
        more = " or -1 (whatever the world size leaves)" if allow_infer else ""
        raise ConfigError(key, value, f"use a positive whole number{more}.")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension of a run; their product is the world size.

    ``dp_replicate`` x ``dp_shard`` ranks hold distinct data (DDP replicates, FSDP/ZeRO shards); each of them is a
    group of ``tp`` ranks that split one replica's layers and read the same micro-batches. Context and pipeline
    parallelism (``cp``, ``pp``) are reserved and refused until they are implemented.

    Args:
        dp_replicate: ranks that replicate the (sharded) model.
        dp_shard: ranks that shard parameters, gradients or optimizer state (ZeRO, FSDP) within one replica group.
        tp: ranks of one tensor-parallel group.
        world_size: processes of the job.
        cp: context-parallel ranks (reserved: must be 1).
        pp: pipeline stages (reserved: must be 1).

    Raises:
        ConfigError: a size that is not a positive whole number.
        IncompatibleConfigError: ``cp``/``pp`` other than 1, or sizes whose product is not the world size.

    Example::

        dims = ParallelDims.from_world(world_size=4, tp=2)  # dp_shard=2: 2 replicas of 2 ranks each
        dims.dp, dims.dp_rank(3)  # (2, 1)
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    cp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "world_size", "cp", "pp"):
            _check_size(f"parallel_dims.{name}", getattr(self, name))
        for name in ("cp", "pp"):
            if getattr(self, name) != 1:
                kind = "context" if name == "cp" else "pipeline"
                raise IncompatibleConfigError(
                    {f"parallel_dims.{name}": getattr(self, name)},
                    f"{kind} parallelism is not supported yet.",
                    f"use {name}=1 (split the ranks over dp_replicate, dp_shard and tp).",
                )
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise IncompatibleConfigError(
                {"parallel_dims": self.to_dict(), "world_size": self.world_size},
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} = {product} ranks, "
                f"not the world size {self.world_size}.",
                "make the product of the sizes equal the world size.",
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: replicas that read distinct samples (``dp_replicate`` x ``dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def devices_per_replica(self) -> int:
        """Ranks that share one data-parallel replica's micro-batches (``world_size / dp``)."""
        return self.world_size // self.dp

    def dp_rank(self, global_rank: int) -> int:
        """The data-parallel rank of ``global_rank`` (ranks of one tensor-parallel group share it)."""
        self._check_rank(global_rank)
        return global_rank // (self.tp * self.cp)

    def tp_rank(self, global_rank: int) -> int:
        """The rank of ``global_rank`` within its tensor-parallel group."""
        self._check_rank(global_rank)
        return global_rank % self.tp

    def sampler_kwargs(self, global_rank: int) -> dict[str, int]:
        """``{"num_replicas", "rank"}`` for a distributed sampler (Lightning's ``distributed_sampler_kwargs``)."""
        return {"num_replicas": self.dp, "rank": self.dp_rank(global_rank)}

    def to_dict(self) -> dict[str, int]:
        """``{"dp_replicate", "dp_shard", "tp"}`` for metrics.json."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    def _check_rank(self, global_rank: int) -> None:
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"global rank {global_rank} is outside a world of {self.world_size} ranks")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, dp_replicate: int = 1, dp_shard: int = -1) -> ParallelDims:
        """Dims of ``world_size`` ranks; ``dp_shard=-1`` takes whatever ``dp_replicate`` x ``tp`` leave.

        Raises:
            ConfigError: a size that is not a positive whole number (``dp_shard`` may be -1).
            IncompatibleConfigError: the world size is not divisible by ``tp`` or ``dp_replicate`` x ``tp``, or the
                product of the sizes is not the world size.
        """
        return cls.from_config(world_size, 1, tp=tp, dp_replicate=dp_replicate, dp_shard=dp_shard)

    @classmethod
    def from_config(
        cls, devices: int, num_nodes: int = 1, tp: int = 1, dp_replicate: int = 1, dp_shard: int = -1
    ) -> ParallelDims:
        """Dims of ``devices`` x ``num_nodes`` ranks (the ``trainer`` node), validated with errors naming the keys.

        Args:
            devices: processes per node (``trainer.devices``, resolved to a count).
            num_nodes: nodes (``trainer.num_nodes``).
            tp: tensor-parallel size (``strategy.tensor_parallel_size``).
            dp_replicate: replicating data-parallel size (``strategy.replicate``: HSDP's replicas).
            dp_shard: sharding data-parallel size; -1 takes what the others leave.

        Raises:
            ConfigError: a size that is not a positive whole number (``dp_shard`` may be -1).
            IncompatibleConfigError: the world is not divisible by ``tp`` (or ``dp_replicate`` x ``tp``), or the
                product of the sizes is not the world size; the message names the keys and the fix.
        """
        _check_size("trainer.devices", devices)
        _check_size("trainer.num_nodes", num_nodes)
        _check_size("strategy.tensor_parallel_size", tp)
        _check_size("strategy.replicate", dp_replicate)
        _check_size("strategy.data_parallel_size", dp_shard, allow_infer=True)
        world = devices * num_nodes
        keys: dict[str, Any] = {"trainer.devices": devices, "trainer.num_nodes": num_nodes}
        ranks = f"trainer.devices={devices} x num_nodes={num_nodes}"
        if world % tp:
            raise IncompatibleConfigError(
                {**keys, "strategy.tensor_parallel_size": tp},
                f"{ranks} is not divisible by tp={tp}.",
                f"use a device count that is a multiple of {tp}, or a tensor-parallel size that divides {world}.",
            )
        if world % (tp * dp_replicate):
            raise IncompatibleConfigError(
                {**keys, "strategy.replicate": dp_replicate, "strategy.tensor_parallel_size": tp},
                f"{ranks} is not divisible by dp_replicate={dp_replicate} x tp={tp}.",
                f"use a multiple of {tp * dp_replicate} devices, or sizes whose product divides {world}.",
            )
        if dp_shard == -1:
            dp_shard = world // (tp * dp_replicate)
        if dp_replicate * dp_shard * tp != world:
            raise IncompatibleConfigError(
                {**keys, "strategy.data_parallel_size": dp_shard},
                f"{ranks} = {world} ranks, but dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} = "
                f"{dp_replicate * dp_shard * tp}.",
                f"set strategy.data_parallel_size={world // (tp * dp_replicate)}, or -1 (whatever the others leave).",
            )
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=world)

    @classmethod
    def from_mesh(cls, mesh: Any) -> ParallelDims:
        """Dims of a named ``torch.distributed.DeviceMesh`` (Lightning's ``data_parallel``/``tensor_parallel``, or
        torchtitan's ``dp_replicate``/``dp_shard``/``tp``); a dimension absent from the mesh has size 1.

        Raises:
            IncompatibleConfigError: a mesh without dimension names, or with one this package does not know.
        """
        names = mesh.mesh_dim_names
        if not names:
            raise IncompatibleConfigError(
                {"device_mesh.mesh_dim_names": names},
                "the strategy's device mesh has no dimension names, so its data-parallel size cannot be read.",
                "name its dimensions (data_parallel, tensor_parallel, or dp_replicate, dp_shard, tp).",
            )
        sizes = {"dp_replicate": 1, "dp_shard": 1, "tp": 1}
        for name in names:
            if name not in _MESH_DIMS:
                raise IncompatibleConfigError(
                    {"device_mesh.mesh_dim_names": names},
                    f"the dimension {name!r} is not one this package knows; context and pipeline parallelism are not "
                    "supported yet.",
                    f"name the mesh's dimensions from {sorted(_MESH_DIMS)}.",
                )
            sizes[_MESH_DIMS[name]] = int(mesh[name].size())
        return cls(**sizes, world_size=int(mesh.size()))

    @classmethod
    def from_strategy(cls, strategy: Any, world_size: int | None = None) -> ParallelDims:
        """Dims of a Lightning strategy: its ``device_mesh`` when it has one (``ModelParallelStrategy`` after setup),
        else every rank a data-parallel replica (DDP, FSDP, DeepSpeed, one device).

        Args:
            strategy: the strategy (``None``: a single process, or only ``world_size`` known).
            world_size: the job's processes (default: the strategy's ``world_size``).

        Raises:
            IncompatibleConfigError: the mesh (see :meth:`from_mesh`) or the strategy's ``distributed_sampler_kwargs``
                disagree with the world size, so the sampler would read other shards than the figures count.
        """
        dims = cls.of_layout(strategy, world_size)
        world = dims.world_size
        sampler = getattr(strategy, "distributed_sampler_kwargs", None) if world > 1 else None
        rank = int(getattr(strategy, "global_rank", 0) or 0)
        if isinstance(sampler, dict) and sampler.get("num_replicas") is not None:
            expected = dims.sampler_kwargs(rank)
            if {k: sampler.get(k) for k in expected} != expected:
                raise IncompatibleConfigError(
                    {f"{type(strategy).__name__}.distributed_sampler_kwargs": sampler, "parallel_dims": dims.to_dict()},
                    f"the sampler would shard otherwise than the data-parallel ranks of the layout ({expected} on "
                    f"global rank {rank}), so the figures would count other samples than were read.",
                    "return ParallelDims.sampler_kwargs(global_rank) from the strategy's distributed_sampler_kwargs.",
                )
        return dims

    @classmethod
    def of_layout(cls, strategy: Any, world_size: int | None = None) -> ParallelDims:
        """Dims of a strategy's layout alone: its ``device_mesh`` when it has one, else every rank a replica.

        What our strategies' ``distributed_sampler_kwargs`` are made from
        (:class:`~lightning_trainopt.parallel.ddp.DimsSampling`); :meth:`from_strategy` also checks the sampler.

        Raises:
            IncompatibleConfigError: the mesh has no known dimension names, or holds another number of ranks than
                the world.
        """
        world = int(world_size if world_size is not None else getattr(strategy, "world_size", 1) or 1)
        mesh = _mesh_of(strategy)
        dims = cls.from_mesh(mesh) if mesh is not None else cls(dp_replicate=1, dp_shard=world, tp=1, world_size=world)
        if dims.world_size != world:
            raise IncompatibleConfigError(
                {"device_mesh": dims.to_dict(), "world_size": world},
                f"the strategy's device mesh holds {dims.world_size} ranks, not the world size {world}.",
                "build the mesh over all ranks.",
            )
        return dims

    @classmethod
    def from_trainer(cls, trainer: Any) -> ParallelDims:
        """Dims of a Trainer's strategy (:meth:`from_strategy` at ``trainer.world_size``): the one function that
        train.py, every callback and metrics.json read the data-parallel size through."""
        return cls.from_strategy(getattr(trainer, "strategy", None), int(trainer.world_size))


def _mesh_of(strategy: Any) -> Any | None:
    """The strategy's device mesh, or ``None`` where it has none (yet)."""
    if strategy is None or not hasattr(type(strategy), "device_mesh"):
        return None
    try:
        return strategy.device_mesh
    except RuntimeError:
        # ModelParallelStrategy raises until setup_environment builds the mesh; its world is not split yet.
        return None
