"""prepare_corpus: text, JSONL and Parquet into token shards, the manifest, idempotent and resumable runs, refusals."""

from __future__ import annotations

import json
import shutil
import socket

import numpy as np
import pytest

from lightning_trainopt.data import BpeTokenizer, LocalTokenizer, Manifest, prepare_corpus
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.prepared import STDLIB, decode_documents, prepare_stdlib, read_stream, stdlib_sample


@pytest.fixture(scope="module")
def stdlib_bpe(tmp_path_factory):
    """``json/*.py`` prepared once with a 512-id BPE (several shards); tests that only read it share it."""
    out = tmp_path_factory.mktemp("stdlib_bpe")
    prepare_stdlib(out)
    return out


class _Recorder:
    def __init__(self, fail_after_shards: int | None = None) -> None:
        self.phases: list[str] = []
        self.shards: list[str] = []
        self.fail_after_shards = fail_after_shards

    def phase(self, name, files):
        self.phases.append(name)

    def update(self, files_done, documents, tokens):
        pass

    def shard(self, shard):
        self.shards.append(shard.file)
        if self.fail_after_shards is not None and len(self.shards) == self.fail_after_shards:
            raise KeyboardInterrupt  # the user's Ctrl-C, after this shard and its manifest are written


def test_bpe_on_stdlib_text_round_trips_every_document(stdlib_bpe):
    manifest = json.loads((stdlib_bpe / "manifest.json").read_text())
    files = stdlib_sample()
    # One document per text file, in path order, each decoded back to the file's exact text.
    assert decode_documents(stdlib_bpe, stdlib_bpe / "tokenizer.json") == [f.read_text() for f in files]
    assert manifest["documents"] == len(files) == 5
    assert manifest["complete"] is True
    assert manifest["tokenizer"]["kind"] == "bpe"
    assert manifest["tokenizer"]["file"] == "tokenizer.json"
    assert manifest["vocab_size"] == 512
    assert manifest["dtype"] == "uint16"
    assert manifest["eos_token"] == "<|endoftext|>"


def test_manifest_counts_the_tokens_really_written(stdlib_bpe):
    from tokenizers import Tokenizer

    manifest = json.loads((stdlib_bpe / "manifest.json").read_text())
    stream = read_stream(stdlib_bpe)
    assert manifest["tokens"] == len(stream) == sum(s["tokens"] for s in manifest["shards"])
    assert manifest["tokens"] == sum((stdlib_bpe / s["file"]).stat().st_size for s in manifest["shards"]) // 2
    assert manifest["eos_id"] == Tokenizer.from_file(str(stdlib_bpe / "tokenizer.json")).token_to_id("<|endoftext|>")
    assert stream.count(manifest["eos_id"]) == manifest["documents"]
    assert max(stream) < manifest["vocab_size"]
    # Documents are never split: every shard ends with an EOS, and holds as many as it says.
    assert len(manifest["shards"]) >= 3
    for shard in manifest["shards"]:
        tokens = np.fromfile(stdlib_bpe / shard["file"], dtype=np.uint16)
        assert tokens[-1] == manifest["eos_id"]
        assert int((tokens == manifest["eos_id"]).sum()) == shard["documents"]


def test_jsonl_and_parquet_records_are_documents(tmp_path, stdlib_bpe):
    import datasets

    texts = [f.read_text() for f in stdlib_sample()]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    datasets.Dataset.from_dict({"id": [1, 2, 3], "body": [texts[0], None, texts[1]]}).to_json(
        str(corpus / "a.jsonl"), lines=True
    )
    datasets.Dataset.from_dict({"body": [texts[2], "", texts[3]], "n": [1, 2, 3]}).to_parquet(str(corpus / "b.parquet"))
    out = tmp_path / "out"
    manifest = prepare_corpus(
        str(corpus), out, LocalTokenizer(str(stdlib_bpe / "tokenizer.json")), text_column="body", shard_tokens=10**6
    )
    assert decode_documents(out, stdlib_bpe / "tokenizer.json") == [texts[0], texts[1], texts[2], texts[3]]
    assert (manifest.documents, manifest.skipped_documents) == (4, 2)  # the null and the empty record
    assert manifest.tokenizer["kind"] == "local"
    assert manifest.vocab_size == 512
    assert not (out / "tokenizer.json").exists()  # a local tokenizer is recorded by path and digest, not copied
    assert [f["format"] for f in manifest.config["input"]] == ["json", "parquet"]


def test_a_transformers_tokenizer_directory_is_read_offline(tmp_path, stdlib_bpe, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path / "tok"
    PreTrainedTokenizerFast(
        tokenizer_file=str(stdlib_bpe / "tokenizer.json"), eos_token="<|endoftext|>"
    ).save_pretrained(directory)

    def no_network(*args, **kwargs):
        raise AssertionError("prepare tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    manifest = prepare_corpus(str(STDLIB / "json" / "tool.py"), tmp_path / "out", LocalTokenizer(str(directory)))
    assert manifest.eos_id == 0  # from tokenizer_config.json's eos_token
    assert manifest.documents == 1
    assert decode_documents(tmp_path / "out", stdlib_bpe / "tokenizer.json") == [
        (STDLIB / "json" / "tool.py").read_text()
    ]


def test_a_second_run_with_the_same_inputs_writes_nothing(stdlib_bpe):
    before = {p.name: p.stat().st_mtime_ns for p in stdlib_bpe.iterdir()}
    recorder = _Recorder()
    manifest = prepare_stdlib(stdlib_bpe, progress=recorder)
    assert recorder.phases == []
    assert {p.name: p.stat().st_mtime_ns for p in stdlib_bpe.iterdir()} == before
    assert manifest == Manifest.read(stdlib_bpe)


def test_an_interrupted_run_continues_after_its_last_shard(tmp_path, stdlib_bpe):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare_stdlib(out, progress=_Recorder(fail_after_shards=2))
    assert Manifest.read(out).complete is False
    assert len(Manifest.read(out).shards) == 2
    first = (out / "shard-00000.bin").stat().st_mtime_ns
    (out / "shard-00002.bin").write_bytes(b"\x00\x01")  # a shard left half-written, which no manifest records
    recorder = _Recorder()
    manifest = prepare_stdlib(out, progress=recorder)
    assert recorder.phases == ["tokenize"]  # the BPE is not trained again
    assert recorder.shards[0] == "shard-00002.bin"  # the first two are kept as they are
    assert (out / "shard-00000.bin").stat().st_mtime_ns == first
    assert manifest.complete
    # The same bytes as the uninterrupted run.
    assert read_stream(out) == read_stream(stdlib_bpe)
    assert manifest.shards == Manifest.read(stdlib_bpe).shards


def test_changed_input_is_refused_and_overwrite_rebuilds(tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(STDLIB / "json", corpus, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    tokenizer = BpeTokenizer(vocab_size=400)
    prepare_corpus(str(corpus), out, tokenizer)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConfigError) as err:
        prepare_corpus(str(corpus), out, BpeTokenizer(vocab_size=300))
    assert (err.value.key, err.value.value) == ("tokenizer.vocab_size", 300)
    (corpus / "scanner.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="overwrite=true") as err:
        prepare_corpus(str(corpus), out, tokenizer)
    assert err.value.key == "input"
    assert "scanner.py (changed size or modification time)" in str(err.value.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    manifest = prepare_corpus(str(corpus), out, tokenizer, overwrite=True)
    assert manifest.complete
    assert "x = 1\n" in decode_documents(out, out / "tokenizer.json")
    assert manifest.tokens == len(read_stream(out))


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda tmp: prepare_corpus(str(tmp / "nothing" / "*.txt"), tmp / "out", BpeTokenizer(512)), "input"),
        (
            lambda tmp: prepare_corpus(str(tmp / "c.jsonl"), tmp / "out", BpeTokenizer(512), text_column="body"),
            "text_column",
        ),
        (
            lambda tmp: prepare_corpus(str(tmp / "c.jsonl"), tmp / "out", BpeTokenizer(vocab_size=100)),
            "tokenizer.vocab_size",
        ),
        (lambda tmp: prepare_corpus(str(tmp / "c.jsonl"), tmp / "out", LocalTokenizer("gpt2")), "tokenizer.path"),
        (
            lambda tmp: prepare_corpus(str(tmp / "c.jsonl"), tmp / "out", BpeTokenizer(512), shard_tokens=0),
            "shard_tokens",
        ),
        (lambda tmp: prepare_corpus(str(tmp / "c.jsonl"), tmp / "out", BpeTokenizer(512), format="csv"), "format"),
        (
            lambda tmp: prepare_corpus(str(tmp / "c.jsonl"), tmp / "out", BpeTokenizer(512), encoding="utf-9"),
            "encoding",
        ),
    ],
    ids=["no-match", "unknown-column", "vocab-too-small", "hub-name", "shard-tokens", "format", "encoding"],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, make, key):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ConfigError) as err:
        make(tmp_path)
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}=")
    assert not (tmp_path / "out").exists()


def test_an_output_directory_of_other_files_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no manifest.json") as err:
        prepare_corpus(str(STDLIB / "json" / "tool.py"), tmp_path / "out", BpeTokenizer(512))
    assert err.value.key == "output"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_an_output_inside_the_input_directory_is_never_read(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    manifest = prepare_corpus(str(tmp_path), tmp_path / "tokens", BpeTokenizer(300))
    assert [f["path"] for f in manifest.config["input"]] == [str((tmp_path / "a.txt").resolve())]
    recorder = _Recorder()
    prepare_corpus(str(tmp_path), tmp_path / "tokens", BpeTokenizer(300), progress=recorder)
    assert recorder.phases == []  # its own shards are not new input


def test_a_tokenizer_without_a_known_end_token_needs_one_named(tmp_path, stdlib_bpe):
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ConfigError, match="end-of-document") as err:
        prepare_corpus(str(STDLIB / "json" / "tool.py"), tmp_path / "out", LocalTokenizer(str(tmp_path / "plain.json")))
    assert err.value.key == "tokenizer.eos_token"
    with pytest.raises(ConfigError) as err:
        LocalTokenizer(str(stdlib_bpe / "tokenizer.json"), eos_token="</s>").identity()
    assert (err.value.key, err.value.value) == ("tokenizer.eos_token", "</s>")
    assert not (tmp_path / "out").exists()


def test_a_text_file_in_another_encoding_is_named(tmp_path):
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match="encoding=latin-1") as err:
        prepare_corpus(str(tmp_path / "latin.txt"), tmp_path / "out", BpeTokenizer(300))
    assert err.value.key == "input"
    # Nothing was tokenized yet, so the same output starts again with the other encoding, without overwrite=true.
    prepare_corpus(str(tmp_path / "latin.txt"), tmp_path / "out", BpeTokenizer(300), encoding="latin-1")
    assert decode_documents(tmp_path / "out", tmp_path / "out" / "tokenizer.json") == ["café"]


def test_the_end_token_written_in_a_document_is_text(tmp_path, stdlib_bpe):
    text = 'SEPARATOR = "<|endoftext|>"  # GPT-2\'s end of document\n'
    (tmp_path / "gpt2_notes.py").write_text(text)
    out = tmp_path / "out"
    manifest = prepare_corpus(str(tmp_path / "gpt2_notes.py"), out, LocalTokenizer(str(stdlib_bpe / "tokenizer.json")))
    stream = read_stream(out)
    assert stream.count(manifest.eos_id) == 1  # only the EOS that ends the document
    assert stream[-1] == manifest.eos_id
    assert decode_documents(out, stdlib_bpe / "tokenizer.json") == [text]
