"""PackedTokens: fixed-length next-token samples cut from token shards on disk, read through NumPy memmaps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_trainopt.data.manifest import Manifest

__all__ = ["PackedTokens"]


class PackedTokens(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens of the shards' concatenation, as ``(inputs, targets)``.

    The shards hold documents back to back, each followed by the EOS id, so a window packs whole and partial
    documents with EOS between them (packing: no padding, no token dropped but the tail after the last full
    window). Sample ``i`` covers tokens ``[start + i * seq_len, start + (i + 1) * seq_len + 1)`` of the stream; a
    window may span two shards. The shards are opened as read-only memmaps on first use in each process (not
    pickled to DataLoader workers), so only the pages read are loaded.

    Args:
        directory: the prepared directory.
        manifest: its manifest (shard files, token counts, dtype, EOS id).
        seq_len: tokens per sample.
        start: first token of the range (in the whole stream).
        stop: end of the range (exclusive).

    Example::

        manifest = Manifest.read("data/stdlib_bpe")
        train = PackedTokens(Path("data/stdlib_bpe"), manifest, seq_len=128, start=0, stop=manifest.tokens)
        x, y = train[0]
    """

    def __init__(self, directory: Path, manifest: Manifest, seq_len: int, start: int, stop: int) -> None:
        self.files = [directory / s.file for s in manifest.shards]
        self.dtype = np.dtype(manifest.dtype)
        self.eos_id = int(manifest.eos_id or 0)  # a complete manifest has one (Manifest.check_shards)
        # offsets[k] is the stream position of shard k's first token; offsets[-1] the total.
        self.offsets = np.concatenate([[0], np.cumsum([s.tokens for s in manifest.shards])]).astype(np.int64)
        self.seq_len = seq_len
        self.start = start
        self.stop = stop
        self.n = max(stop - start - 1, 0) // seq_len
        self._maps: list[np.memmap] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = None  # a worker opens its own maps; pickling one would copy the whole shard
        return state

    def __len__(self) -> int:
        return self.n

    def tokens(self, begin: int, end: int) -> np.ndarray:
        """Tokens ``[begin, end)`` of the whole stream, across shard boundaries."""
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self.files]
        first = int(np.searchsorted(self.offsets, begin, side="right")) - 1
        pieces = []
        k = first
        while begin < end:
            local = begin - int(self.offsets[k])
            take = min(end, int(self.offsets[k + 1])) - begin
            pieces.append(self._maps[k][local : local + take])
            begin += take
            k += 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        begin = self.start + i * self.seq_len
        chunk = torch.from_numpy(self.tokens(begin, begin + self.seq_len + 1).astype(np.int64))
        return chunk[:-1], chunk[1:]

    def document_starts(self, i: int) -> torch.Tensor:
        """Positions in sample ``i``'s inputs where a document starts: 0, and each position after an EOS.

        For attention that should not cross documents (e.g. the cumulative sequence lengths of a variable-length
        kernel): the documents in the window are ``inputs[s[j]:s[j + 1]]``.
        """
        inputs, _ = self[i]
        after_eos = torch.nonzero(inputs[:-1] == self.eos_id).flatten() + 1
        return torch.cat([torch.zeros(1, dtype=torch.long), after_eos])
