"""The documents of a local corpus: text files (one document each), JSONL and Parquet (one per record).

JSONL and Parquet are read with Hugging Face ``datasets`` from local files, streamed (nothing is copied into its
cache); a record's document is its ``text_column``.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_trainopt.data.tokenizer import hf_offline
from lightning_trainopt.exceptions import ConfigError, MissingDependencyError

__all__ = ["FORMATS", "InputFile", "check_text_column", "iter_documents", "resolve_inputs"]

Format = Literal["text", "json", "parquet"]
FORMATS = ("auto", "text", "json", "parquet")

_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_BY_SUFFIX: dict[str, Format] = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet"}
_GLOB_CHARS = frozenset("*?[")
_READ_BATCH = 1000


@dataclass(frozen=True)
class InputFile:
    """One input file, how it is read, and what identifies its content (size and modification time)."""

    path: Path
    format: Format
    size: int
    mtime_ns: int

    def identity(self) -> dict[str, Any]:
        return {"path": str(self.path), "format": self.format, "size": self.size, "mtime_ns": self.mtime_ns}


def _format_of(path: Path, fmt: str) -> Format:
    if fmt != "auto":
        return fmt  # type: ignore[return-value]  # checked against FORMATS by the caller
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return _BY_SUFFIX.get(suffixes[-1], "text") if suffixes else "text"


def _expand(pattern: str, key: str, skip: Path | None) -> list[Path]:
    where = Path(pattern).expanduser()
    if _GLOB_CHARS & set(pattern):
        # glob leaves out hidden files and folders itself.
        files = sorted(p for p in map(Path, glob.glob(str(where), recursive=True)) if p.is_file())
    elif where.is_dir():
        under = (p for p in where.rglob("*") if p.is_file())
        files = sorted(p for p in under if not any(s.startswith(".") for s in p.relative_to(where).parts))
    else:
        files = [where] if where.is_file() else []
    if skip is not None:
        files = [p for p in files if not p.resolve().is_relative_to(skip)]
    if not files:
        raise ConfigError(
            key,
            pattern,
            "no file matches it; give an existing file, a directory (every file under it is read) or a glob, e.g. "
            f"{key}='data/**/*.jsonl' (quote it so that the shell leaves the * to prepare).",
        )
    return files


def resolve_inputs(
    patterns: str | Sequence[str], fmt: str = "auto", key: str = "input", exclude: Path | None = None
) -> list[InputFile]:
    """The input files, in order: each pattern's files sorted by path, duplicates dropped.

    Args:
        patterns: a file, a directory (every file under it, hidden files excepted), a glob (``**`` recurses), or a
            list of those.
        fmt: ``auto`` (by extension: ``.jsonl``/``.json``/``.ndjson`` -> json, ``.parquet`` -> parquet, compressed
            ``.gz``/``.bz2``/``.xz``/``.zst`` JSON too; anything else -> text), or the format of every file.
        key: the config key of ``patterns``, for errors.
        exclude: a directory whose files are never input (``prepare``'s output).

    Raises:
        ConfigError: a pattern matches no file (outside ``exclude``), or ``fmt`` is unknown.
    """
    if fmt not in FORMATS:
        raise ConfigError("format", fmt, f"use one of {', '.join(FORMATS)}.")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError(key, patterns, f"give a file, directory or glob, e.g. {key}='corpus/*.txt'.")
    skip = exclude.expanduser().resolve() if exclude is not None else None
    seen: set[Path] = set()
    out: list[InputFile] = []
    for pattern in patterns:
        for path in _expand(pattern, key, skip):
            resolved = path.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            stat = resolved.stat()
            out.append(InputFile(resolved, _format_of(resolved, fmt), stat.st_size, stat.st_mtime_ns))
    return out


def _stream(file: InputFile) -> Any:
    hf_offline()
    try:
        import datasets
    except ImportError as err:
        raise MissingDependencyError("datasets", "data", f"Reading {file.format} input") from err
    datasets.disable_progress_bars()
    return datasets.load_dataset(file.format, data_files=str(file.path), split="train", streaming=True)


def check_text_column(files: Sequence[InputFile], column: str, key: str = "text_column") -> None:
    """Raise unless every JSONL/Parquet file has the column ``column`` (reads a few records of each, writes nothing).

    Raises:
        ConfigError: a file lacks the column; the message lists the columns it has.
    """
    for file in files:
        if file.format == "text" or file.size == 0:
            continue
        columns = _stream(file).column_names
        if columns is not None and column not in columns:
            raise ConfigError(
                key, column, f"{file.path} has no such column; its columns are {columns}: set {key} to the text's."
            )


def iter_documents(
    files: Sequence[InputFile],
    column: str = "text",
    encoding: str = "utf-8",
    start: tuple[int, int] = (0, 0),
) -> Iterator[tuple[int, int, str | None]]:
    """``(file index, record index, text)`` of every document from ``start`` on, in order.

    A text file is one document (record 0); a JSONL/Parquet file has one per record, its ``column``, ``None`` where
    the record's value is null. ``start`` is ``(file index, record index)`` of the first document to read.

    Raises:
        ConfigError: a text file that is not ``encoding``, or a record whose ``column`` is not a string.
    """
    first_file, first_record = start
    for index in range(first_file, len(files)):
        file = files[index]
        skip = first_record if index == first_file else 0
        if file.format == "text":
            if skip == 0:
                yield index, 0, _decode(file, encoding)
            continue
        stream = _stream(file)
        if file.size == 0 or stream.column_names is None:
            continue
        stream = stream.select_columns([column])
        if skip:
            stream = stream.skip(skip)
        record = skip
        for batch in stream.iter(batch_size=_READ_BATCH):
            for text in batch[column]:
                if text is not None and not isinstance(text, str):
                    raise ConfigError(
                        "text_column",
                        column,
                        f"record {record} of {file.path} holds a {type(text).__name__}, not text; name a text column.",
                    )
                yield index, record, text
                record += 1


def _decode(file: InputFile, encoding: str) -> str:
    data = file.path.read_bytes()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as err:
        raise ConfigError(
            "input",
            str(file.path),
            f"byte {err.start} is not {encoding} ({err.reason}); convert the file, leave it out of the input, or set "
            "encoding= to its encoding (e.g. encoding=latin-1).",
        ) from err
