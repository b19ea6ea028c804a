"""ResumableSampler: one data-parallel rank's share of an epoch's global sample order, from any position in it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import override

__all__ = ["ResumableSampler"]


class ResumableSampler(DistributedSampler):
    """The samples of one rank, dealt from one global order per epoch that any world size reads alike.

    Epoch ``e``'s global order is a permutation of the whole dataset, ``torch.randperm`` seeded with ``seed + e``
    (the order :class:`~torch.utils.data.distributed.DistributedSampler` uses), or ``0, 1, 2, ...`` without
    shuffling. ``position`` samples of it are consumed; the rest is dealt round-robin (rank ``r`` of ``W`` reads
    ``rest[r], rest[r + W], ...``) and a tail that would not give every rank the same count is dropped. So ranks
    never overlap, every rank reads the same number of samples, and when each rank has read ``k`` samples the ranks
    together have read exactly the first ``k * W`` samples of the order, whatever ``W`` is: a position counted in
    global samples means the same data for any number of ranks.

    The position is advanced by whoever knows what was consumed (:class:`ResumableDataLoader` counts the batches it
    hands out, not the indices its workers fetched ahead); an iteration starts at the position it finds.
    :meth:`set_epoch` with a new epoch starts that epoch's order from its beginning. Being a ``DistributedSampler``,
    it is not replaced by the one Lightning injects (``Trainer(use_distributed_sampler=True)``), and Lightning
    calls its :meth:`set_epoch` at every epoch start.

    Args:
        dataset: the map-style dataset, with a length (only the length is read).
        num_replicas: data-parallel replicas (``ParallelDims.dp``).
        rank: this process's data-parallel rank.
        shuffle: permute each epoch (else the dataset's own order).
        seed: seed of the permutation (the epoch is added to it).

    Example::

        sampler = ResumableSampler(dataset, num_replicas=2, rank=0, seed=1234)
        sampler.set_epoch(3)
        sampler.position = 4096  # the first 4096 samples of epoch 3's order are consumed
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.position = 0

    @override
    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s order next: from its beginning if it is a new epoch, else from ``position``."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def order(self) -> torch.Tensor:
        """The current epoch's global sample order (every rank computes the same one)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def remaining_per_rank(self, position: int | None = None) -> int:
        """Samples each rank still reads in this epoch from ``position`` (default: the current one)."""
        consumed = self.position if position is None else position
        return max(len(self.dataset) - consumed, 0) // self.num_replicas  # type: ignore[arg-type]

    @override
    def __iter__(self) -> Iterator[int]:
        rest = self.order()[self.position :]
        end = self.remaining_per_rank() * self.num_replicas
        return iter(rest[self.rank : end : self.num_replicas].tolist())

    @override
    def __len__(self) -> int:
        # The whole epoch, also when iteration starts mid-epoch: Lightning counts a resumed epoch's batches on from
        # the checkpoint's batch index, so the epoch length it sees must not shrink with the position.
        return len(self.dataset) // self.num_replicas  # type: ignore[arg-type]
