"""The data-parallel sampler of every strategy the app builds, from :class:`ParallelDims`; DDP with it.

Lightning hands each rank's training sampler ``trainer.distributed_sampler_kwargs`` (``num_replicas``, ``rank``),
which each of its strategies works out on its own: DDP and DeepSpeed as one replica per rank, ``ModelParallelStrategy``
from its mesh. Our strategies take them from the run's :class:`~lightning_trainopt.parallel.dims.ParallelDims` instead
(:class:`DimsSampling`), the one place that says which ranks hold one replica: under tensor parallelism the ranks of
one group read the same samples, and the figures (tokens/s, MFU, $, global batch) count what was read. A strategy of
the user's own is still checked against the layout when training starts (``ParallelDims.from_strategy``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.spec import StrategySpec

__all__ = ["DimsSampling", "TrainOptDDPStrategy"]


class DimsSampling:
    """Mix into a Lightning ``ParallelStrategy`` (before it in the bases): its ``distributed_sampler_kwargs`` are
    :meth:`ParallelDims.sampler_kwargs` of its layout (:meth:`ParallelDims.of_layout`: the mesh, else one replica per
    rank)."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """``{"num_replicas": dp, "rank": dp_rank}`` of this rank (ranks of one tensor-parallel group share it)."""
        return ParallelDims.of_layout(self).sampler_kwargs(int(getattr(self, "global_rank", 0)))


class TrainOptDDPStrategy(DimsSampling, DDPStrategy):
    """Lightning's ``DDPStrategy`` whose sampler reads :class:`ParallelDims` and which carries its spec
    (the ``ddp`` preset).

    Args:
        preset: what metrics.json calls it.
        **kwargs: Lightning's ``DDPStrategy`` arguments (and through them torch's ``DistributedDataParallel``'s).

    Example::

        Trainer(accelerator="cpu", devices=2, strategy=TrainOptDDPStrategy())
    """

    def __init__(self, preset: str = "ddp", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.preset = preset
        target = f"{type(self).__module__}.{type(self).__qualname__}"
        #: What the rooms below parallel/ ask instead of testing the class (``with_spec``).
        self.spec = StrategySpec(name=preset, kind="ddp", target=target)
