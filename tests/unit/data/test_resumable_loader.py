"""ResumableSampler / ResumableDataLoader: sharding, per-epoch shuffles, and the position a checkpoint carries."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_trainopt.data import ResumableDataLoader, ResumableSampler, TextDataModule
from lightning_trainopt.exceptions import ConfigError

N = 23  # not a multiple of any geometry below: every epoch drops a tail
DATA = TensorDataset(torch.arange(N))


def _loaders(batch_size: int, ranks: int, **kwargs) -> list[ResumableDataLoader]:
    return [ResumableDataLoader(DATA, batch_size, seed=7, num_replicas=ranks, rank=r, **kwargs) for r in range(ranks)]


def _steps(loaders: list[ResumableDataLoader], epochs: int, steps: int | None = None) -> list[set[int]]:
    """The samples all ranks read per batch step, over ``epochs`` epochs as Lightning's fit loop drives them.

    Lightning calls ``set_epoch(epoch)`` before each epoch and reads ``len(loader)`` batches; a resumed loader is in
    the middle of its first epoch. Stops after ``steps`` batch steps when given.
    """
    out: list[set[int]] = []
    first = loaders[0].resumable_sampler.epoch
    for epoch in range(first, first + epochs):
        for loader in loaders:
            loader.resumable_sampler.set_epoch(epoch)
        for batches in zip(*(iter(loader) for loader in loaders)):
            out.append({int(i) for (b,) in batches for i in b})
            if steps is not None and len(out) == steps:
                return out
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_ranks_read_disjoint_equal_shares_of_one_global_order(ranks):
    samplers = [ResumableSampler(DATA, num_replicas=ranks, rank=r, seed=7) for r in range(ranks)]
    shares = [list(s) for s in samplers]
    assert {len(share) for share in shares} == {N // ranks}
    read = [i for share in shares for i in share]
    assert len(set(read)) == len(read)  # no sample on two ranks
    order = samplers[0].order().tolist()
    assert set(read) == set(order[: N // ranks * ranks])  # the first samples of the global order, the tail dropped


def test_every_epoch_has_its_own_order_fixed_by_the_seed():
    def order(seed: int, epoch: int) -> list[int]:
        sampler = ResumableSampler(DATA, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(7, 0) != order(7, 1)
    assert order(7, 1) == order(7, 1)
    assert order(7, 1) != order(8, 1)
    assert sorted(order(7, 3)) == list(range(N))


def test_set_epoch_starts_a_new_epoch_from_its_beginning():
    sampler = ResumableSampler(DATA, seed=7)
    sampler.position = 8
    sampler.set_epoch(0)  # the epoch it is in: Lightning's call at a resumed epoch's start keeps the position
    assert (sampler.epoch, sampler.position) == (0, 8)
    assert len(list(sampler)) == N - 8
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.position) == (1, 0)
    assert len(sampler) == N  # the whole epoch, also mid-epoch: Lightning counts a resumed epoch's batches on


# (killed geometry) -> (resumed geometry), as (micro-batch, ranks): the same global batch, so the same batch count.
@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 2), (2, 2)), ((2, 2), (4, 1)), ((4, 1), (1, 4)), ((3, 1), (3, 1))],
    ids=["same", "2x2-to-1x4", "1x4-to-4x1", "one-rank"],
)
@pytest.mark.parametrize("killed_after", [3, 7], ids=["epoch0", "epoch1"])
def test_a_resumed_loader_reads_what_the_uninterrupted_one_would(before, after, killed_after):
    uninterrupted = _steps(_loaders(*before), epochs=4)
    killed = _loaders(*before)
    _steps(killed, epochs=4, steps=killed_after)
    states = [loader.state_dict() for loader in killed]
    assert all(state == states[0] for state in states)  # any rank's copy serves all: the checkpoint keeps rank 0's
    resumed = _loaders(*after)
    for loader in resumed:
        loader.load_state_dict(states[0])
    rest = _steps(resumed, epochs=4)
    assert rest[: len(uninterrupted) - killed_after] == uninterrupted[killed_after:]


def test_the_position_counts_batches_handed_out_not_those_workers_prefetched():
    loader = ResumableDataLoader(DATA, 2, seed=7, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    taken = [next(it)[0].tolist() for _ in range(3)]  # the workers have fetched 4 batches beyond these by now
    state = loader.state_dict()
    del it
    assert state["samples_consumed"] == 6
    resumed = ResumableDataLoader(DATA, 2, seed=7)
    resumed.load_state_dict(state)
    uninterrupted = [b.tolist() for (b,) in ResumableDataLoader(DATA, 2, seed=7)]
    assert taken == uninterrupted[:3]
    assert [b.tolist() for (b,) in resumed] == uninterrupted[3:]


def test_an_epoch_read_to_its_end_continues_with_the_next_epoch():
    loader = ResumableDataLoader(DATA, 4, seed=7)
    assert len(list(loader)) == N // 4
    state = loader.state_dict()  # the iterator ended: the loader moved on to epoch 1
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)

    # Lightning stops an epoch after len(loader) batches without asking for one more: the saved state is the end of
    # epoch 0, which a resume reads as the start of epoch 1 (as Lightning's own progress does).
    ended = ResumableDataLoader(DATA, 4, seed=7)
    it = iter(ended)
    for _ in range(N // 4):
        next(it)
    state = ended.state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (0, N // 4 * 4)
    resumed = ResumableDataLoader(DATA, 2, seed=7, num_replicas=1)  # another geometry: nothing to keep at an edge
    resumed.load_state_dict(state)
    assert (resumed.resumable_sampler.epoch, resumed.resumable_sampler.position) == (1, 0)


def test_at_an_epoch_start_any_geometry_resumes():
    state = ResumableDataLoader(DATA, 2, seed=7, num_replicas=2).state_dict()
    resumed = ResumableDataLoader(DATA, 3, seed=7)
    resumed.load_state_dict(state)
    assert (resumed.resumable_sampler.epoch, resumed.resumable_sampler.position) == (0, 0)


def _mid_epoch_state(**kwargs) -> dict:
    loader = ResumableDataLoader(DATA, 2, seed=7, num_replicas=2, data_options={"seq_len": 32}, **kwargs)
    it = iter(loader)
    next(it)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "key", "fix"),
    [
        ({"batch_size": 2}, "data.batch_size", "data.batch_size=4 on 1 rank."),
        ({"batch_size": 2, "num_replicas": 3}, "data.batch_size", "divides 4 (1, 2, 4)"),
        ({"data_options": {"seq_len": 64}}, "data.seq_len", "data.seq_len=32"),
        ({"shuffle": False}, "data.shuffle", "shuffle=True"),
    ],
    ids=["global-batch", "no-divisor", "data-option", "shuffle"],
)
def test_a_position_that_would_mean_other_samples_is_refused(kwargs, key, fix):
    args = {"batch_size": 4, "num_replicas": 1, "data_options": {"seq_len": 32}, **kwargs}
    loader = ResumableDataLoader(DATA, args.pop("batch_size"), seed=7, **args)
    with pytest.raises(ConfigError) as err:
        loader.load_state_dict(_mid_epoch_state())
    assert err.value.key == key
    assert fix in str(err.value)
    assert "8 samples into epoch 0" in str(err.value)


def test_a_changed_dataset_is_refused_naming_the_corpus():
    options = {"corpus": "stdlib_text", "seq_len": 32}
    saved = ResumableDataLoader(DATA, 2, seed=7, num_replicas=2, data_options=options)
    it = iter(saved)
    next(it)
    grown = TensorDataset(torch.arange(N + 5))  # the same options, more text: another Python's standard library
    loader = ResumableDataLoader(grown, 2, seed=7, num_replicas=2, data_options=options)
    with pytest.raises(ConfigError, match="training set of 23 samples, and this one has 28") as err:
        loader.load_state_dict(saved.state_dict())
    assert err.value.key == "data.corpus"


def test_a_foreign_loader_state_is_refused():
    with pytest.raises(ConfigError) as err:
        ResumableDataLoader(DATA, 2).load_state_dict({"_num_yielded": 3, "_sampler_iter_state": None})
    assert err.value.key == "ckpt_path"


def test_the_checkpoint_seed_is_kept_with_a_warning():
    state = _mid_epoch_state()
    resumed = ResumableDataLoader(DATA, 2, seed=99, num_replicas=2, data_options={"seq_len": 32})
    with pytest.warns(UserWarning, match="continues with the checkpoint's seed"):
        resumed.load_state_dict(state)
    assert resumed.resumable_sampler.seed == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ResumableDataLoader(DATA, 2, seed=7, num_replicas=2, data_options={"seq_len": 32}).load_state_dict(state)


@pytest.fixture(params=["stdlib_text", "text_file", "synthetic"])
def text_data(request, tmp_path):
    if request.param == "text_file":
        (tmp_path / "a.txt").write_text("some text to train on. " * 300)
    dm = TextDataModule(
        corpus=request.param,
        seq_len=16,
        batch_size=4,
        path=str(tmp_path) if request.param == "text_file" else None,
        max_bytes=20_000,
        synthetic_tokens=20_000,
    )
    dm.setup()
    return dm


def test_every_corpus_trains_from_a_resumable_loader(text_data):
    dm = text_data
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableDataLoader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    assert state["data_options"]["corpus"] == dm.corpus
    assert state["samples_consumed"] == 20
    resumed = dm.train_dataloader()
    resumed.load_state_dict(state)
    x, _ = next(iter(resumed))
    assert torch.equal(x, next(it)[0])


def test_the_data_module_shards_by_the_strategy_data_parallel_ranks(text_data):
    dm = text_data
    dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    sampler = dm.train_dataloader().resumable_sampler
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert list(sampler) == sampler.order().tolist()[1 : len(dm.train_set) // 2 * 2 : 2]
