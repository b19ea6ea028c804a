"""Small real corpora for prepare.py tests: files of this Python's standard library, and a BPE trained on them."""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer

from lightning_trainopt.data import BpeTokenizer, Manifest, prepare_corpus

__all__ = ["STDLIB", "decode_documents", "prepare_stdlib", "read_stream", "stdlib_sample"]

STDLIB = Path(os.path.dirname(os.__file__))


def stdlib_sample() -> list[Path]:
    """The five modules of the ``json`` package: 48 kB of real text, present on every machine."""
    return sorted((STDLIB / "json").glob("*.py"))


def prepare_stdlib(out: Path, vocab_size: int = 512, shard_tokens: int = 4000, **kwargs) -> Manifest:
    """``json/*.py`` prepared into ``out`` with a BPE trained on it (several shards at the default size)."""
    return prepare_corpus(
        str(STDLIB / "json" / "*.py"), out, BpeTokenizer(vocab_size=vocab_size), shard_tokens=shard_tokens, **kwargs
    )


def read_stream(out: Path) -> list[int]:
    """Every token of the shards of ``out``, in the manifest's order, read as raw bytes (not through our reader)."""
    import numpy as np

    manifest = Manifest.read(out)
    return [int(t) for s in manifest.shards for t in np.fromfile(out / s.file, dtype=manifest.dtype)]


def decode_documents(out: Path, tokenizer_file: Path) -> list[str]:
    """The documents of ``out``: the stream split at the EOS id, each decoded with ``tokenizer_file``."""
    manifest = Manifest.read(out)
    tok = Tokenizer.from_file(str(tokenizer_file))
    stream = read_stream(out)
    assert stream[-1] == manifest.eos_id, "the stream ends with the last document's EOS"
    docs, current = [], []
    for t in stream:
        if t == manifest.eos_id:
            docs.append(tok.decode(current, skip_special_tokens=False))
            current = []
        else:
            current.append(t)
    return docs
