"""ResumableDataLoader: a training DataLoader whose position in the epoch is saved in Lightning's checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, SequentialSampler
from typing_extensions import override

from lightning_trainopt.data.resumable_sampler import ResumableSampler
from lightning_trainopt.exceptions import ConfigError

__all__ = ["ResumableDataLoader", "check_global_batch", "resume_point"]

STATE_VERSION = 1
_STATE_KEYS = ("version", "epoch", "samples_consumed", "seed", "shuffle", "dataset_size", "batch_size", "num_replicas")


class ResumableDataLoader(DataLoader):
    """A training ``DataLoader`` that a checkpoint taken in the middle of an epoch resumes exactly.

    Lightning saves ``state_dict()`` of every training loader that has one in the checkpoint (the fit loop's
    ``combined_loader`` state) and hands it back to ``load_state_dict()`` on resume, before the first batch. The
    state is the position in the epoch, in global samples consumed: the epoch, the samples all ranks have consumed
    (batches handed out x ``batch_size`` x ``num_replicas``; counted as batches leave the loader, so batches
    that worker processes prefetched do not count), the shuffle seed, and the batch geometry and ``data_options``
    they were read with. Every rank saves the same state, so the checkpoint's one copy (rank 0's) serves them all.

    Sharding is the loader's own (:class:`ResumableSampler`, a ``DistributedSampler`` that Lightning leaves in
    place): rank ``rank`` of ``num_replicas`` reads its share of one global order per epoch, so ranks never
    overlap. Every epoch is shuffled anew (``seed + epoch``), the same in an uninterrupted and a resumed run.

    A resume continues exactly when the checkpoint's position means the same samples in the new run, and is
    refused otherwise (:func:`resume_point`): mid-epoch, the global batch (``batch_size`` x ``num_replicas``) and
    the ``data_options`` must be those of the checkpoint; the world size may change with them, e.g. 2 ranks of 2
    -> 1 rank of 4. A checkpoint at an epoch's start or end resumes with any of them. The checkpoint's seed is kept.

    Args:
        dataset: map-style training dataset.
        batch_size: micro-batch per rank.
        shuffle: a new permutation every epoch (else the dataset's order).
        seed: shuffle seed (the epoch is added to it).
        num_replicas: data-parallel replicas (under Lightning: ``trainer.distributed_sampler_kwargs``, which
            ``ParallelDims.from_trainer`` checks against the strategy's layout; the ranks of one tensor-parallel group
            share a replica's rank and read the same samples).
        rank: this process's data-parallel rank.
        data_options: the options that define the dataset and its order, ``{name: value}``; saved with the
            position and compared on resume.
        config_prefix: the config group that the errors name (``data.batch_size``, ``data.seq_len``, ...).
        **kwargs: further ``DataLoader`` arguments (``num_workers``, ``pin_memory``, ``collate_fn``, ...). The
            loader makes its own sampler and drops incomplete batches; a ``SequentialSampler`` (what Lightning's
            ``Trainer(overfit_batches=...)`` puts in) means ``shuffle=False``, any other sampler is refused.

    Example::

        def train_dataloader(self):
            sharding = self.trainer.distributed_sampler_kwargs or {}
            return ResumableDataLoader(self.train_set, batch_size=16, seed=1234, **sharding)
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        data_options: Mapping[str, Any] | None = None,
        config_prefix: str = "data",
        **kwargs: Any,
    ) -> None:
        given = kwargs.pop("sampler", None), kwargs.pop("batch_sampler", None)
        kwargs.pop("drop_last", None)
        if isinstance(given[0], SequentialSampler) and given[1] is None:
            shuffle = False
        elif given != (None, None):
            raise TypeError(
                f"ResumableDataLoader makes its own sampler (got sampler={given[0]!r}, batch_sampler={given[1]!r}); "
                "pass shuffle=, seed=, num_replicas= and rank= instead."
            )
        sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self.data_options = dict(data_options or {})
        self.config_prefix = config_prefix

    @property
    def resumable_sampler(self) -> ResumableSampler:
        """The sampler that holds the epoch and the position."""
        return cast(ResumableSampler, self.sampler)

    @property
    def samples_per_batch(self) -> int:
        """Samples one batch consumes over all ranks: ``batch_size`` x ``num_replicas``."""
        return cast(int, self.batch_size) * self.resumable_sampler.num_replicas

    @override
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return _CountingIterator(super().__iter__(), self.resumable_sampler, self.samples_per_batch)

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from (the same on every rank)."""
        sampler = self.resumable_sampler
        return {
            "version": STATE_VERSION,
            "epoch": sampler.epoch,
            "samples_consumed": sampler.position,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "dataset_size": len(sampler.dataset),  # type: ignore[arg-type]
            "batch_size": self.batch_size,
            "num_replicas": sampler.num_replicas,
            "data_options": dict(self.data_options),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's position.

        Raises:
            ConfigError: the position cannot be continued exactly (see :func:`resume_point`).
        """
        sampler = self.resumable_sampler
        epoch, position = resume_point(
            state_dict,
            dataset_size=len(sampler.dataset),  # type: ignore[arg-type]
            batch_size=cast(int, self.batch_size),
            num_replicas=sampler.num_replicas,
            shuffle=sampler.shuffle,
            data_options=self.data_options,
            config_prefix=self.config_prefix,
        )
        if state_dict["seed"] != sampler.seed:
            rank_zero_warn(
                f"{self.config_prefix}.seed={sampler.seed} differs from the checkpoint's {state_dict['seed']}: the "
                "data order continues with the checkpoint's seed, so that the resumed epoch reads the samples the "
                "interrupted one had left."
            )
        sampler.seed = state_dict["seed"]
        sampler.epoch = epoch
        sampler.position = position


def resume_point(
    state: Mapping[str, Any],
    *,
    dataset_size: int,
    batch_size: int,
    num_replicas: int,
    shuffle: bool,
    data_options: Mapping[str, Any],
    config_prefix: str = "data",
) -> tuple[int, int]:
    """``(epoch, samples consumed)`` at which a loader of this geometry continues a saved :class:`ResumableDataLoader`.

    A state whose epoch has no full global batch left resumes at the start of the next epoch. One in the middle of
    an epoch resumes at its position only where that position means the same samples and the same batch count:
    the same dataset (size and ``data_options``), the same shuffle, and the same global batch
    (``batch_size`` x ``num_replicas``), since Lightning counts the resumed epoch's batches on from the checkpoint's
    batch index. A state at an epoch's start resumes with any geometry.

    Args:
        state: :meth:`ResumableDataLoader.state_dict` of the checkpoint.
        dataset_size: samples in this run's dataset.
        batch_size: this run's micro-batch per rank.
        num_replicas: this run's data-parallel ranks.
        shuffle: whether this run shuffles.
        data_options: this run's data options (see :class:`ResumableDataLoader`).
        config_prefix: the config group that the errors name.

    Raises:
        ConfigError: the state is not a ResumableDataLoader's, or mid-epoch with another dataset, shuffle or global
            batch; the message names the option and the value that continues exactly.
    """
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing or state["version"] != STATE_VERSION:
        raise ConfigError(
            "ckpt_path",
            f"a checkpoint whose training-loader state has keys {sorted(state)}",
            f"it holds no ResumableDataLoader position (version {STATE_VERSION}, keys {list(_STATE_KEYS)}); resume "
            "from a checkpoint written with this data module, or start a new run.",
        )
    epoch, consumed = int(state["epoch"]), int(state["samples_consumed"])
    saved_batch = int(state["batch_size"]) * int(state["num_replicas"])
    if int(state["dataset_size"]) - consumed < saved_batch:
        return epoch + 1, 0  # the saved epoch had no full batch left: Lightning starts the next one too
    if consumed == 0:
        return epoch, 0
    where = f"the checkpoint stopped {consumed} samples into epoch {epoch}"
    saved_options = dict(state.get("data_options") or {})
    for name in sorted(set(saved_options) | set(data_options)):
        if saved_options.get(name) != data_options.get(name):
            raise ConfigError(
                f"{config_prefix}.{name}",
                data_options.get(name),
                f"{where}, reading with {config_prefix}.{name}={saved_options.get(name)!r}; resume with that value, "
                "so that its position means the same samples.",
            )
    if bool(state["shuffle"]) != shuffle:
        raise ConfigError(
            f"{config_prefix}.shuffle", shuffle, f"{where} with shuffle={state['shuffle']}; resume with that value."
        )
    if int(state["dataset_size"]) != dataset_size:
        name = "corpus" if "corpus" in data_options else next(iter(sorted(data_options)), "dataset")
        raise ConfigError(
            f"{config_prefix}.{name}",
            data_options.get(name, f"{dataset_size} samples"),
            f"{where} of a training set of {state['dataset_size']} samples, and this one has {dataset_size}: the text "
            "changed since (edited files, another Python's standard library); resume with the text it was trained on.",
        )
    check_global_batch(state, batch_size, num_replicas, config_prefix)
    return epoch, consumed


def check_global_batch(
    state: Mapping[str, Any], batch_size: int, num_replicas: int, config_prefix: str = "data"
) -> None:
    """Refuse to continue a saved mid-epoch position with another global batch (``batch_size`` x ``num_replicas``).

    Lightning counts the resumed epoch's batches on from the checkpoint's batch index, so the saved position holds
    only with the saved global batch. Needs nothing but the saved state and the run's geometry, so the app checks it
    before any process starts (the loader checks it again in :func:`resume_point`). A state at an epoch's start, or
    with no full global batch left in its epoch, resumes with any geometry.

    Args:
        state: :meth:`ResumableDataLoader.state_dict` of the checkpoint.
        batch_size: this run's micro-batch per rank.
        num_replicas: this run's data-parallel ranks.
        config_prefix: the config group that the error names.

    Raises:
        ConfigError: mid-epoch with another global batch; the message names the batch size (and ranks) that resume.
    """
    consumed = int(state["samples_consumed"])
    saved_batch = int(state["batch_size"]) * int(state["num_replicas"])
    if consumed == 0 or int(state["dataset_size"]) - consumed < saved_batch or batch_size * num_replicas == saved_batch:
        return
    where = f"the checkpoint stopped {consumed} samples into epoch {int(state['epoch'])}"
    raise ConfigError(
        f"{config_prefix}.batch_size",
        batch_size,
        f"{where}, reading {saved_batch} per batch ({_ranks(state['num_replicas'])} x {state['batch_size']}); "
        f"this run reads {batch_size * num_replicas} ({_ranks(num_replicas)} x {batch_size}), and Lightning counts "
        f"the epoch's batches on from the checkpoint's, so the position holds only with {saved_batch} per batch: "
        f"{_same_global_batch(saved_batch, num_replicas, config_prefix)}",
    )


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _same_global_batch(global_batch: int, num_replicas: int, config_prefix: str) -> str:
    if global_batch % num_replicas == 0:
        return f"resume with {config_prefix}.batch_size={global_batch // num_replicas} on {_ranks(num_replicas)}."
    ranks = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    return (
        f"resume on a number of ranks that divides {global_batch} ({', '.join(map(str, ranks))}), with "
        f"{config_prefix}.batch_size={global_batch} / ranks."
    )


class _CountingIterator:
    """The DataLoader's iterator, advancing the sampler's position by each batch it hands out."""

    def __init__(self, inner: Iterator[Any], sampler: ResumableSampler, samples_per_batch: int) -> None:
        self._inner = inner
        self._sampler = sampler
        self._step = samples_per_batch
        self._ended = False

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except StopIteration:
            if not self._ended:  # the epoch is read to its end: the next iteration reads the next epoch
                self._ended = True
                self._sampler.set_epoch(self._sampler.epoch + 1)
            raise
        self._sampler.position += self._step
        return batch
