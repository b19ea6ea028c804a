"""PackedDataModule: what the packed-sequence data modules share: their knobs, the validation split, the loaders."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_trainopt.data.loader_options import check_loader_options, loader_kwargs
from lightning_trainopt.data.resumable_loader import ResumableDataLoader
from lightning_trainopt.exceptions import ConfigError

__all__ = ["PackedDataModule"]


class PackedDataModule(pl.LightningDataModule):
    """The base of the data modules that pack a token stream into ``seq_len`` sequences (``TextDataModule``,
    ``TokenizedDataModule``).

    A subclass fills ``train_set`` and ``val_set`` in ``setup`` (the tail of the stream, :meth:`split`, is the
    validation split, so it never overlaps training) and says in :meth:`data_options` what decides which sequences
    the training set holds. The training loader is a :class:`ResumableDataLoader`: it shards the data over the
    strategy's data-parallel ranks itself, and a checkpoint saves its position in the epoch, so a run killed
    mid-epoch resumes on the very samples it would have read next.

    Args:
        seq_len: tokens per sequence.
        batch_size: micro-batch per device.
        val_fraction: share of the tokens held out for validation (the tail).
        num_workers, pin_memory, prefetch_factor, persistent_workers: DataLoader knobs; ``pin_memory`` only
            takes effect on CUDA.
        seed: seed of the training shuffle (epoch ``e`` is shuffled with ``seed + e``).

    Raises:
        ConfigError: a bad value, named by its ``data.`` key.

    Example::

        class MyTokens(PackedDataModule):
            def setup(self, stage=None):
                n_train = self.split(len(tokens), "too few tokens; use a shorter seq_len.")
                self.train_set, self.val_set = MySequences(tokens[:n_train]), MySequences(tokens[n_train:])

            def data_options(self):
                return {"seq_len": self.seq_len, "val_fraction": self.val_fraction}
    """

    def __init__(
        self,
        seq_len: int,
        batch_size: int,
        val_fraction: float,
        num_workers: int,
        pin_memory: bool,
        prefetch_factor: int | None,
        persistent_workers: bool,
        seed: int,
    ) -> None:
        super().__init__()
        for key, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"data.{key}", value, "use a positive integer.")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
            raise ConfigError("data.val_fraction", val_fraction, "use a fraction between 0 and 1.")
        check_loader_options(num_workers, pin_memory, prefetch_factor, persistent_workers)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.seed = seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def split(self, total: int, too_few: str) -> int:
        """Tokens of the training split of a stream of ``total``; the rest (at least one sequence) is validation.

        Raises:
            ConfigError: ``data.seq_len`` leaves no training and validation sequence; ``too_few`` is the fix.
        """
        n_val = max(self.seq_len + 1, int(total * self.val_fraction))
        if total - n_val < self.seq_len + 1:
            raise ConfigError("data.seq_len", self.seq_len, too_few)
        return total - n_val

    def data_options(self) -> dict[str, Any]:
        """The options that decide which sequences the training set holds, saved with the loader's position."""
        raise NotImplementedError(f"{type(self).__name__} must say which options decide its training set")

    def _loader_kwargs(self) -> dict[str, Any]:
        return loader_kwargs(self.num_workers, self.pin_memory, self.prefetch_factor, self.persistent_workers)

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        """A :class:`ResumableDataLoader` over the data-parallel ranks; a checkpoint saves its position."""
        assert self.train_set is not None
        sharding = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        return ResumableDataLoader(
            self.train_set,
            batch_size=self.batch_size,
            seed=self.seed,
            num_replicas=sharding.get("num_replicas", 1),
            rank=sharding.get("rank", 0),
            data_options=self.data_options(),
            # Worker seeds come from this generator, not from the global RNG (which the model may draw from).
            generator=torch.Generator().manual_seed(self.seed),
            **self._loader_kwargs(),
        )

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, **self._loader_kwargs())
