"""prepare_corpus: local text, JSONL or Parquet files -> token shards and a ``manifest.json``, resumably."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lightning_trainopt.data.documents import InputFile, check_text_column, iter_documents, resolve_inputs
from lightning_trainopt.data.manifest import MANIFEST_FILE, Manifest, Shard
from lightning_trainopt.data.tokenizer import TextTokenizer, token_dtype
from lightning_trainopt.data.tokenizer_sources import TOKENIZER_FILE, TokenizerSource
from lightning_trainopt.exceptions import ConfigError

__all__ = ["PrepareProgress", "prepare_corpus", "shard_name"]


class PrepareProgress(Protocol):
    """What :func:`prepare_corpus` reports as it goes (the app draws it; tests may record it)."""

    def phase(self, name: str, files: int) -> None:
        """A pass over the ``files`` input files begins (``train`` the BPE, or ``tokenize``)."""

    def update(self, files_done: int, documents: int, tokens: int) -> None:
        """Totals so far in this pass (``tokens`` counts only in ``tokenize``, resumed shards included)."""

    def shard(self, shard: Shard) -> None:
        """A shard file is written and recorded in the manifest."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def _settings(
    files: Sequence[InputFile], text_column: str, encoding: str, shard_tokens: int, tokenizer: dict[str, Any]
) -> dict[str, Any]:
    """Everything that decides the shards' bytes, as the manifest's ``config`` records it."""
    formats = {f.format for f in files}
    config: dict[str, Any] = {"input": [f.identity() for f in files]}
    if formats - {"text"}:
        config["text_column"] = text_column
    if "text" in formats:
        config["encoding"] = encoding
    config.update(shard_tokens=shard_tokens, tokenizer=tokenizer)
    return config


def _fingerprint(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _what_changed(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, Any]:
    """The first setting (as a config key, with its new value) in which ``new`` differs from ``old``."""
    for name in ("input", "text_column", "encoding", "shard_tokens"):
        if old.get(name) != new.get(name):
            if name == "input":
                return "input", _input_change(old.get("input") or [], new["input"])
            return name, new.get(name)
    old_tok, new_tok = old.get("tokenizer") or {}, new["tokenizer"]
    if old_tok.get("kind") != new_tok["kind"]:
        return "tokenizer", new_tok["kind"]
    for name in sorted(set(old_tok) | set(new_tok)):
        if old_tok.get(name) != new_tok.get(name):
            if name == "sha256":  # a local tokenizer whose files changed: same path, other digest
                return "tokenizer.path", new_tok.get("path")
            return f"tokenizer.{name}", new_tok.get(name)
    return "output", "another prepare version"


def _input_change(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    old_by_path = {f["path"]: f for f in old}
    for f in new:
        if f["path"] not in old_by_path:
            return f"{f['path']} (new)"
        if old_by_path[f["path"]] != f:
            return f"{f['path']} (changed size or modification time)"
    gone = sorted(set(old_by_path) - {f["path"] for f in new})
    return f"{gone[0]} (no longer an input)" if gone else "the files in another order"


def _existing_manifest(output: Path) -> Manifest | None:
    """The manifest already in ``output``, ``None`` for a new or empty directory.

    Raises:
        ConfigError: ``output`` is a file, or a directory holding other files and no manifest.
    """
    if not output.exists():
        return None
    if not output.is_dir():
        raise ConfigError("output", str(output), "it is a file; give a directory for the shards.")
    if (output / MANIFEST_FILE).is_file():
        return Manifest.read(output, key="output")
    if any(output.iterdir()):
        raise ConfigError(
            "output",
            str(output),
            f"the directory holds files but no {MANIFEST_FILE}, so it was not written by prepare; give a new or empty "
            "directory.",
        )
    return None


def _remove_outputs(output: Path, manifest: Manifest) -> None:
    """Delete what a previous ``prepare`` wrote in ``output`` (its shards, tokenizer and manifest), nothing else."""
    names = {s.file for s in manifest.shards} | {TOKENIZER_FILE, MANIFEST_FILE}
    shard_like = {p.name for p in output.glob("shard-*.bin*")}  # unrecorded shards of an interrupted run too
    for name in names | shard_like:
        (output / name).unlink(missing_ok=True)


def _check_values(shard_tokens: Any, batch_documents: Any, encoding: Any, overwrite: Any) -> None:
    for key, value in (("shard_tokens", shard_tokens), ("batch_documents", batch_documents)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(key, value, "use a positive integer.")
    try:
        codecs.lookup(encoding)
    except (LookupError, TypeError) as err:
        raise ConfigError("encoding", encoding, "no such text encoding; use e.g. utf-8 or latin-1.") from err
    if not isinstance(overwrite, bool):
        raise ConfigError("overwrite", overwrite, "use true or false.")


def prepare_corpus(
    input: str | Sequence[str],
    output: str | Path,
    tokenizer: TokenizerSource,
    *,
    format: str = "auto",
    text_column: str = "text",
    encoding: str = "utf-8",
    shard_tokens: int = 50_000_000,
    batch_documents: int = 1000,
    overwrite: bool = False,
    progress: PrepareProgress | None = None,
) -> Manifest:
    """Tokenize the documents of ``input`` into shards in ``output``, each document followed by the EOS id.

    Every input is checked (files match, JSONL/Parquet files have ``text_column``, the tokenizer loads and has an
    end token, the values are in range) before anything is written. The manifest is rewritten after every shard,
    so an interrupted run, started again with the same command, continues after the last shard it recorded; a
    finished one is left as it is. A directory prepared with other inputs (a file added, removed, or modified:
    size or modification time), another tokenizer or other options is refused, naming what changed, unless
    ``overwrite=True``, which deletes what that ``prepare`` wrote and starts again (a run that stopped before its
    first shard is started again without it).

    Args:
        input: files, directories or globs (see :func:`~lightning_trainopt.data.documents.resolve_inputs`).
        output: the directory for ``shard-NNNNN.bin``, ``manifest.json`` and a trained ``tokenizer.json``.
        tokenizer: a :class:`~lightning_trainopt.data.tokenizer_sources.BpeTokenizer` or ``LocalTokenizer``.
        format: ``auto`` (by file extension), ``text``, ``json`` or ``parquet``.
        text_column: the field of a JSONL/Parquet record that holds the document.
        encoding: the encoding of text files.
        shard_tokens: a shard is closed after the document that brings it to this many tokens (documents are never
            split between shards).
        batch_documents: documents per call to the tokenizer (it encodes a batch on all cores).
        overwrite: rebuild a directory prepared with other settings instead of refusing.
        progress: told of each pass, the running totals and each shard.

    Returns:
        The manifest of the complete preparation.

    Raises:
        ConfigError: a bad input or value, or an output directory prepared otherwise (without ``overwrite``).
    """
    _check_values(shard_tokens, batch_documents, encoding, overwrite)
    out = Path(output).expanduser()
    # The output may lie under an input directory (input=corpus/ output=corpus/tokens): its files are never input.
    files = resolve_inputs(input, format, exclude=out)
    check_text_column(files, text_column)
    config = _settings(files, text_column, encoding, shard_tokens, tokenizer.identity())
    fingerprint = _fingerprint(config)
    manifest = _existing_manifest(out)
    if manifest is not None and manifest.fingerprint != fingerprint:
        # A run stopped before its first shard (a file that did not decode, say) has nothing worth keeping.
        if not overwrite and (manifest.complete or manifest.shards):
            key, value = _what_changed(manifest.config, config)
            raise ConfigError(
                key,
                value,
                f"output={str(out)!r} was prepared with other settings ({key} differs); its shards would mix two "
                "corpora: give a new output directory, or add overwrite=true to delete them and prepare again.",
            )
        _remove_outputs(out, manifest)
        manifest = None
    if manifest is not None and manifest.complete:
        return manifest
    if manifest is None:
        manifest = Manifest(fingerprint=fingerprint, config=config)
    out.mkdir(parents=True, exist_ok=True)
    manifest.write(out)

    def texts() -> Iterator[str]:
        done, last = 0, 0
        for index, _, text in iter_documents(files, text_column, encoding):
            done += 1
            if progress is not None and (index != last or done % batch_documents == 0):
                progress.update(index, done, 0)
            last = index
            if text:
                yield text
        if progress is not None:
            progress.update(len(files), done, 0)

    if progress is not None and config["tokenizer"]["kind"] == "bpe" and not (out / TOKENIZER_FILE).is_file():
        progress.phase("train", len(files))
    tok = tokenizer.build(out, texts)
    _record_tokenizer(manifest, tok, out)
    manifest.write(out)
    _tokenize(files, out, manifest, tok, text_column, encoding, shard_tokens, batch_documents, progress)
    manifest.complete = True
    manifest.write(out)
    return manifest


def _record_tokenizer(manifest: Manifest, tok: TextTokenizer, out: Path) -> None:
    identity = manifest.config["tokenizer"]
    summary = {**identity, "sha256": tok.sha256}
    if identity["kind"] == "bpe":
        summary["file"] = TOKENIZER_FILE
    if manifest.tokenizer and manifest.tokenizer != summary:
        raise ConfigError(
            "output",
            str(out),
            f"its {TOKENIZER_FILE} changed after shards were written with it; add overwrite=true to prepare again.",
        )
    manifest.tokenizer = summary
    manifest.vocab_size = tok.vocab_size
    manifest.eos_id = tok.eos_id
    manifest.eos_token = tok.eos_token
    manifest.dtype = token_dtype(tok.vocab_size)


def _batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _tokenize(
    files: Sequence[InputFile],
    out: Path,
    manifest: Manifest,
    tok: TextTokenizer,
    text_column: str,
    encoding: str,
    shard_tokens: int,
    batch_documents: int,
    progress: PrepareProgress | None,
) -> None:
    """Encode from the last intact shard on, writing a shard (then the manifest) every ``shard_tokens`` tokens."""
    intact = list(itertools.takewhile(lambda s: manifest.shard_size_problem(out, s) is None, manifest.shards))
    manifest.shards = intact
    manifest.skipped_documents = sum(s.skipped for s in intact)
    start = intact[-1].end if intact else (0, 0)
    dtype = np.dtype(manifest.dtype)
    pieces: list[np.ndarray] = []
    pending = {"tokens": 0, "documents": 0, "skipped": 0}
    totals = {"documents": manifest.documents, "tokens": manifest.tokens}

    def flush(end: tuple[int, int]) -> None:
        path = out / shard_name(len(manifest.shards))
        partial = path.with_name(path.name + ".tmp")
        np.concatenate(pieces).tofile(partial)
        os.replace(partial, path)
        shard = Shard(path.name, pending["tokens"], pending["documents"], pending["skipped"], end)
        manifest.shards.append(shard)
        manifest.skipped_documents += pending["skipped"]
        manifest.write(out)
        pieces.clear()
        pending.update(tokens=0, documents=0, skipped=0)
        if progress is not None:
            progress.shard(shard)

    if progress is not None:
        progress.phase("tokenize", len(files))
        progress.update(start[0], totals["documents"], totals["tokens"])
    for batch in _batches(iter_documents(files, text_column, encoding, start), batch_documents):
        texts = [text for _, _, text in batch if text]
        encoded = iter(tok.encode_batch(texts))
        for index, record, text in batch:
            if not text:
                pending["skipped"] += 1
                continue
            ids = next(encoded)
            doc = np.empty(len(ids) + 1, dtype=dtype)
            doc[:-1] = ids
            doc[-1] = tok.eos_id
            pieces.append(doc)
            pending["tokens"] += len(doc)
            pending["documents"] += 1
            totals["tokens"] += len(doc)
            totals["documents"] += 1
            if pending["tokens"] >= shard_tokens:
                flush((index, record + 1))
        if progress is not None:
            progress.update(batch[-1][0], totals["documents"], totals["tokens"])
    if pieces:
        flush((len(files), 0))
    else:
        manifest.skipped_documents += pending["skipped"]
    if progress is not None:
        progress.update(len(files), totals["documents"], totals["tokens"])
