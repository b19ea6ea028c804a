"""Byte-level text corpora that need no download: the Python standard library, a user's files, or random tokens."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from lightning_trainopt.exceptions import ConfigError

__all__ = ["ByteTokenizer", "read_text_corpus", "stdlib_files"]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: no vocabulary file, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library ``.py`` sources, sorted by relative path (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune installed packages: they differ between machines and are far larger than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _files_under(path: Path, key: str) -> list[Path]:
    if not path.exists():
        raise ConfigError(key, str(path), "the path does not exist; give an existing text file or folder.")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        raise ConfigError(key, str(path), "the folder holds no files; point it at text files.")
    return files


def read_text_corpus(files: list[Path], max_bytes: int | None, key: str) -> torch.Tensor:
    """Concatenate the files' bytes (in the given order, up to ``max_bytes``) into one uint8 tensor."""
    chunks: list[bytes] = []
    total = 0
    for f in files:
        data = f.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if total == 0:
        raise ConfigError(key, ", ".join(str(f) for f in files[:3]), "the text is empty; give non-empty files.")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def user_text_files(path: str | Path, key: str = "data.path") -> list[Path]:
    """Files of a user's text corpus: one file, or every file under a folder in sorted order."""
    return _files_under(Path(path).expanduser(), key)
