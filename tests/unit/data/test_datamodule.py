from __future__ import annotations

import pytest
import torch

from lightning_trainopt.data import ByteTokenizer, TextDataModule
from lightning_trainopt.data.corpus import stdlib_files
from lightning_trainopt.exceptions import ConfigError


def test_stdlib_corpus_is_real_deterministic_text():
    files = stdlib_files()
    assert len(files) > 100
    assert files == stdlib_files()
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_packed_sequences_are_shifted_by_one():
    dm = TextDataModule(corpus="stdlib_text", seq_len=64, batch_size=4, max_bytes=200_000)
    dm.setup()
    x, y = dm.train_set[3]
    assert x.shape == y.shape == (64,)
    assert torch.equal(x[1:], y[:-1])
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 64)
    assert xb.dtype == torch.long


def test_validation_is_held_out_tail():
    dm = TextDataModule(corpus="synthetic", seq_len=16, batch_size=2, synthetic_tokens=10_000, val_fraction=0.1)
    dm.setup()
    n_val_tokens = len(dm.val_set.tokens)
    assert n_val_tokens == 1000
    assert len(dm.train_set.tokens) + n_val_tokens == 10_000


def test_text_file_reads_a_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 200)
    (tmp_path / "b.txt").write_text("more text " * 200)
    dm = TextDataModule(corpus="text_file", path=str(tmp_path), seq_len=32, batch_size=2)
    dm.check_source()
    dm.setup()
    assert ByteTokenizer().decode(dm.train_set[0][0][:5]) == "hello"


def test_synthetic_covers_the_vocabulary():
    dm = TextDataModule(corpus="synthetic", seq_len=16, batch_size=2, vocab_size=1000, synthetic_tokens=50_000)
    dm.setup()
    assert int(dm.train_set.tokens.max()) > 255


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"corpus": "text_file"}, "data.path"),
        ({"seq_len": 0}, "data.seq_len"),
        ({"num_workers": 0, "prefetch_factor": 2}, "data.prefetch_factor"),
        ({"corpus": "wiki"}, "data.corpus"),
    ],
)
def test_bad_data_options(kwargs, key):
    with pytest.raises(ConfigError) as err:
        TextDataModule(**kwargs)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"val_fraction": "0.1"}, "data.val_fraction"),
        ({"max_bytes": 0}, "data.max_bytes"),
        ({"max_bytes": "10"}, "data.max_bytes"),
        # A string was used as a truth value: "maybe" pinned memory.
        ({"pin_memory": "maybe"}, "data.pin_memory"),
        ({"num_workers": 2, "persistent_workers": "no"}, "data.persistent_workers"),
        ({"num_workers": 2, "prefetch_factor": 0}, "data.prefetch_factor"),
        ({"num_workers": True}, "data.num_workers"),
    ],
)
def test_bad_values_name_their_own_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        TextDataModule(corpus="synthetic", **kwargs)
    assert err.value.key == key
