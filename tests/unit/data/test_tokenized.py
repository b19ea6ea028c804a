"""TokenizedDataModule: packing with EOS separators, rank sharding without loss or overlap, exact mid-epoch resume."""

from __future__ import annotations

import json
import pickle
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_trainopt.data import (
    Manifest,
    PackedTokens,
    ResumableDataLoader,
    ResumableSampler,
    TokenizedDataModule,
)
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.prepared import prepare_stdlib, read_stream

SEQ = 32


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """``json/*.py`` with a 512-id BPE in shards of about 4000 tokens (windows span shard boundaries)."""
    out = tmp_path_factory.mktemp("tokenized")
    prepare_stdlib(out)
    return out


def _datamodule(path, **kwargs) -> TokenizedDataModule:
    dm = TokenizedDataModule(str(path), **{"seq_len": SEQ, "batch_size": 4, **kwargs})
    dm.setup()
    return dm


def test_vocab_and_eos_come_from_the_manifest(prepared):
    dm = TokenizedDataModule(str(prepared))
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert (dm.vocab_size, dm.eos_id) == (manifest["vocab_size"], manifest["eos_id"]) == (512, 0)


def test_samples_are_the_stream_cut_into_windows_shifted_by_one(prepared):
    dm = _datamodule(prepared)
    stream = torch.tensor(read_stream(prepared))
    train, val = dm.train_set, dm.val_set
    assert (train.start, train.stop, val.start, val.stop) == (0, val.start, train.stop, len(stream))
    n_val = max(SEQ + 1, int(len(stream) * 0.02))
    assert val.start == len(stream) - n_val  # the tail, never overlapping training
    for ds in (train, val):
        for i in range(len(ds)):
            x, y = ds[i]
            begin = ds.start + i * SEQ
            assert torch.equal(x, stream[begin : begin + SEQ])
            assert torch.equal(y, stream[begin + 1 : begin + SEQ + 1])
    assert len(train) == (train.stop - 1) // SEQ
    # Windows run across shard boundaries and documents: EOS separators inside samples.
    boundaries = torch.tensor([s.tokens for s in Manifest.read(prepared).shards]).cumsum(0)[:-1]
    assert (boundaries % SEQ != 0).any()  # a shard ends inside a window, which the loop above read whole
    assert sum(int((train[i][0] == dm.eos_id).sum()) for i in range(len(train))) >= 3


def test_document_starts_follow_each_eos(prepared):
    dm = _datamodule(prepared)
    ds = dm.train_set
    i = next(i for i in range(len(ds)) if (ds[i][0][:-1] == dm.eos_id).any())
    x, _ = ds[i]
    starts = ds.document_starts(i).tolist()
    assert starts[0] == 0
    assert starts[1:] == [p + 1 for p in range(SEQ - 1) if x[p] == dm.eos_id]


def test_two_ranks_read_every_sample_once(prepared):
    dm = _datamodule(prepared)
    ds = dm.train_set
    indices = [set(ResumableSampler(ds, num_replicas=2, rank=rank, seed=7)) for rank in range(2)]
    assert not indices[0] & indices[1]
    union = indices[0] | indices[1]
    assert union <= set(range(len(ds)))
    assert len(union) == len(ds) // 2 * 2  # all but an odd one out, which neither rank reads
    per_rank = []
    for rank in range(2):
        loader = ResumableDataLoader(ds, batch_size=4, seed=7, num_replicas=2, rank=rank)
        per_rank.append(torch.cat([x for x, _ in loader]))
    both = torch.cat(per_rank)
    # Every rank the same count; together every training window exactly once, but for the tail that would not
    # give both ranks a full batch.
    assert per_rank[0].shape == per_rank[1].shape
    usable = len(ds) // 8 * 8
    assert both.shape[0] == usable
    # As multisets of windows (some code repeats, so a window can occur twice in the stream): what the ranks read
    # is contained in the training set, and what they left is the tail alone.
    seen = Counter(tuple(row.tolist()) for row in both)
    everything = Counter(tuple(ds[i][0].tolist()) for i in range(len(ds)))
    assert not seen - everything
    assert sum((everything - seen).values()) == len(ds) - usable


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_a_new_loader_continues_exactly_from_a_saved_position(prepared):
    dm = _datamodule(prepared)
    first = dm.train_dataloader()
    _batches(first, 5)
    state = first.state_dict()
    expected = _batches(first, 4)

    again = _datamodule(prepared)
    resumed = again.train_dataloader()
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(_batches(resumed, 4), expected, strict=True):
        assert torch.equal(x, ex)
        assert torch.equal(y, ey)


def test_two_ranks_resume_as_one_with_the_same_global_batch(prepared):
    ranks = [
        ResumableDataLoader(_datamodule(prepared).train_set, batch_size=2, seed=3, num_replicas=2, rank=r)
        for r in range(2)
    ]
    for loader in ranks:
        _batches(loader, 3)
    state = ranks[0].state_dict()
    expected = {tuple(x.tolist()) for loader in ranks for batch in _batches(loader, 2) for x in batch[0]}
    alone = ResumableDataLoader(_datamodule(prepared).train_set, batch_size=4, seed=3)
    alone.load_state_dict(state)
    assert {tuple(x.tolist()) for batch in _batches(alone, 2) for x in batch[0]} == expected


def test_the_dataset_pickles_without_its_memmaps(prepared):
    ds = _datamodule(prepared).train_set
    ds[0]  # opens the maps
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 10_000
    assert torch.equal(clone[5][0], ds[5][0])


def test_a_two_worker_loader_reads_the_same_batches(prepared):
    plain = _datamodule(prepared).train_dataloader()
    workers = _datamodule(prepared, num_workers=2).train_dataloader()
    for (x, _), (wx, _) in zip(_batches(plain, 3), _batches(workers, 3), strict=True):
        assert torch.equal(x, wx)


def test_refusals_name_the_key(tmp_path, prepared):
    with pytest.raises(ConfigError, match="data=tokenized needs data.path") as err:
        TokenizedDataModule(None)
    with pytest.raises(ConfigError, match="written by prepare.py") as err:
        TokenizedDataModule(str(tmp_path))
    assert err.value.key == "data.path"
    with pytest.raises(ConfigError) as err:
        TokenizedDataModule(str(prepared), seq_len=0)
    assert err.value.key == "data.seq_len"
    with pytest.raises(ConfigError) as err:
        TokenizedDataModule(str(prepared), prefetch_factor=2)
    assert err.value.key == "data.prefetch_factor"
    with pytest.raises(ConfigError, match="too few") as err:
        TokenizedDataModule(str(prepared), seq_len=30_000).check_source()
    assert err.value.key == "data.seq_len"


def test_an_unfinished_or_damaged_preparation_is_refused(tmp_path, prepared):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    (copy / "shard-00001.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ConfigError, match="shard-00001.bin has 2 bytes") as err:
        TokenizedDataModule(str(copy)).check_source()
    assert err.value.key == "data.path"
    manifest = Manifest.read(copy)
    manifest.complete = False
    manifest.write(copy)
    with pytest.raises(ConfigError, match="has not finished"):
        TokenizedDataModule(str(copy)).check_source()


def test_a_sample_spanning_shards_reads_both(prepared):
    manifest = Manifest.read(prepared)
    boundary = manifest.shards[0].tokens
    ds = PackedTokens(prepared, manifest, seq_len=10, start=boundary - 5, stop=manifest.tokens)
    stream = read_stream(prepared)
    assert ds.tokens(boundary - 5, boundary + 6).tolist() == stream[boundary - 5 : boundary + 6]
    assert ds[0][0].tolist() == stream[boundary - 5 : boundary + 5]


class _Recorder(pl.LightningModule):
    """Records the sequences of every training batch; learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        return (self.weight * batch[0].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(prepared, ckpt_dir, ckpt_path=None) -> _Recorder:
    module = _Recorder()
    saving = ckpt_path is None
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=8,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=saving,
        callbacks=[ModelCheckpoint(ckpt_dir, "{step}", every_n_train_steps=1, save_top_k=-1)] if saving else [],
    )
    trainer.fit(module, datamodule=TokenizedDataModule(str(prepared), seq_len=SEQ, batch_size=4), ckpt_path=ckpt_path)
    return module


def test_a_fit_resumed_mid_epoch_reads_what_the_uninterrupted_fit_read(prepared, tmp_path):
    whole = _fit(prepared, tmp_path).seen
    resumed = _fit(prepared, tmp_path, ckpt_path=tmp_path / "step=3.ckpt").seen
    assert len(whole) == 8
    assert len(resumed) == 5
    for x, expected in zip(resumed, whole[3:], strict=True):
        assert torch.equal(x, expected)
