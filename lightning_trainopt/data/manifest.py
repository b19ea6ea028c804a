"""Manifest: the ``manifest.json`` that ``prepare`` writes beside its token shards, and the data module reads."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_trainopt.exceptions import ConfigError

__all__ = ["MANIFEST_FILE", "Manifest", "Shard"]

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Shard:
    """One token file: ``tokens`` ids of ``dtype``, ``documents`` whole documents each ending with the EOS id.

    ``end`` is ``(file index, record index)`` of the first input document after this shard (where a resumed
    ``prepare`` reads on); ``skipped`` counts the empty documents read into it (nothing written for them).
    """

    file: str
    tokens: int
    documents: int
    skipped: int
    end: tuple[int, int]


@dataclass
class Manifest:
    """What a prepared directory holds, and the settings that made it.

    ``config`` holds everything that decides the token ids (the inputs with their sizes and modification times,
    the reading options, the tokenizer's identity) and ``fingerprint`` its digest: a ``prepare`` with another
    fingerprint does not reuse these shards. ``complete`` is false while ``prepare`` is still writing.

    Args:
        fingerprint: sha256 of ``config``.
        config: the settings, as JSON values.
        tokenizer: the tokenizer used (``kind``, ``path`` or ``file``, ``sha256``, ...).
        vocab_size: token ids the model needs (the largest id + 1).
        eos_id: the id after every document.
        eos_token: its text.
        dtype: NumPy dtype of the shards (``uint16`` up to 65536 ids, else ``uint32``).
        shards: the token files, in corpus order.
        skipped_documents: empty documents (not written).
        complete: every input was read.
    """

    fingerprint: str
    config: dict[str, Any]
    tokenizer: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None
    eos_id: int | None = None
    eos_token: str | None = None
    dtype: str | None = None
    shards: list[Shard] = field(default_factory=list)
    skipped_documents: int = 0
    complete: bool = False

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(format_version=FORMAT_VERSION, tokens=self.tokens, documents=self.documents)
        out["shards"] = [{**asdict(s), "end": list(s.end)} for s in self.shards]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        shards = [Shard(**{**s, "end": tuple(s["end"])}) for s in data["shards"]]
        names = {f for f in cls.__dataclass_fields__ if f != "shards"}
        return cls(**{k: v for k, v in data.items() if k in names}, shards=shards)

    def write(self, directory: Path) -> None:
        """Write ``directory/manifest.json`` atomically (a crash leaves the previous one whole)."""
        path = directory / MANIFEST_FILE
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(partial, path)

    @classmethod
    def read(cls, directory: str | Path, key: str = "data.path") -> Manifest:
        """The manifest of ``directory``.

        Raises:
            ConfigError: no readable manifest of this format there.
        """
        path = Path(directory).expanduser() / MANIFEST_FILE
        if not path.is_file():
            raise ConfigError(
                key,
                str(directory),
                f"it holds no {MANIFEST_FILE}; point it at a directory written by prepare.py (trainopt-prepare "
                f"input=... output={directory}).",
            )
        try:
            data = json.loads(path.read_text())
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}")
            return cls.from_json(data)
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                key, str(directory), f"its {MANIFEST_FILE} is not one prepare.py writes ({err}); prepare it again."
            ) from err

    def shard_size_problem(self, directory: Path, shard: Shard) -> str | None:
        """Why ``shard``'s file in ``directory`` is not what the manifest says (``None``: it is)."""
        expected = shard.tokens * np.dtype(self.dtype).itemsize
        path = directory / shard.file
        if not path.is_file():
            return f"{shard.file} is missing"
        size = path.stat().st_size
        if size != expected:
            return f"{shard.file} has {size} bytes, the manifest {expected} ({shard.tokens} {self.dtype} tokens)"
        return None

    def check_shards(self, directory: Path, key: str = "data.path") -> None:
        """Raise unless the preparation is complete and every shard file has the size the manifest gives it.

        Raises:
            ConfigError: ``prepare`` has not finished, or a shard is missing or has another size.
        """
        if not self.complete:
            raise ConfigError(
                key,
                str(directory),
                "prepare.py has not finished writing it; run the same prepare command again, it continues where it "
                "stopped.",
            )
        if self.vocab_size is None or self.eos_id is None or self.dtype is None:
            raise ConfigError(
                key, str(directory), f"its {MANIFEST_FILE} lacks vocab_size, eos_id or dtype; prepare it again."
            )
        for shard in self.shards:
            problem = self.shard_size_problem(directory, shard)
            if problem is not None:
                raise ConfigError(
                    key, str(directory), f"{problem}; run the same prepare command with overwrite=true to rebuild it."
                )
