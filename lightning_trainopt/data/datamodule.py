"""LightningDataModule that packs a byte corpus into fixed-length next-token sequences."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_trainopt.data.corpus import read_text_corpus, stdlib_files, user_text_files
from lightning_trainopt.data.packed_datamodule import PackedDataModule
from lightning_trainopt.exceptions import ConfigError

__all__ = ["PackedSequences", "TextDataModule"]

Corpus = Literal["stdlib_text", "text_file", "synthetic"]


class PackedSequences(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens, returned as ``(inputs, targets)`` shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class TextDataModule(PackedDataModule):
    """Packed byte-level language-modelling data.

    Args:
        corpus: ``stdlib_text`` (this Python's standard-library sources), ``text_file`` (``path``) or
            ``synthetic`` (uniform random tokens, for throughput).
        seq_len: tokens per sequence.
        batch_size: micro-batch per device.
        path: file or folder for ``text_file``.
        val_fraction: share of the corpus held out for validation (the tail, so it never overlaps training).
        max_bytes: read at most this many bytes of text (``None``: all).
        synthetic_tokens: corpus size for ``synthetic``.
        vocab_size: token ids for ``synthetic`` (text corpora are bytes, 0..255).
        num_workers, pin_memory, prefetch_factor, persistent_workers: DataLoader knobs; ``pin_memory`` only
            takes effect on CUDA.
        seed: seed of the synthetic tokens and of the training shuffle (epoch ``e`` is shuffled with ``seed + e``).

    The loaders are :class:`PackedDataModule`'s: the training loader is resumable mid-epoch and sharded over the
    data-parallel ranks.

    Example::

        dm = TextDataModule(corpus="synthetic", seq_len=64, batch_size=8)
    """

    train_set: PackedSequences | None
    val_set: PackedSequences | None

    def __init__(
        self,
        corpus: Corpus = "stdlib_text",
        seq_len: int = 128,
        batch_size: int = 16,
        path: str | None = None,
        val_fraction: float = 0.02,
        max_bytes: int | None = None,
        synthetic_tokens: int = 1_000_000,
        vocab_size: int = 256,
        num_workers: int = 0,
        pin_memory: bool = True,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        seed: int = 1234,
    ) -> None:
        super().__init__(
            seq_len, batch_size, val_fraction, num_workers, pin_memory, prefetch_factor, persistent_workers, seed
        )
        if corpus not in ("stdlib_text", "text_file", "synthetic"):
            raise ConfigError("data.corpus", corpus, "use one of stdlib_text, text_file, synthetic.")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ConfigError("data.max_bytes", max_bytes, "use a positive number of bytes, or null to read all.")
        if corpus == "text_file" and not path:
            raise ConfigError("data.path", path, "data=text_file needs data.path=/path/to/file_or_folder.")
        self.corpus = corpus
        self.path = path
        self.max_bytes = max_bytes
        self.synthetic_tokens = synthetic_tokens
        self.vocab_size = vocab_size

    def check_source(self) -> None:
        """Raise :class:`ConfigError` now if the corpus is missing or empty (called before any process spawns)."""
        if self.corpus == "text_file":
            read_text_corpus(user_text_files(self.path or ""), max_bytes=1, key="data.path")

    def load_tokens(self) -> torch.Tensor:
        if self.corpus == "synthetic":
            g = torch.Generator().manual_seed(self.seed)
            dtype = torch.uint8 if self.vocab_size <= 256 else torch.int32
            return torch.randint(0, self.vocab_size, (self.synthetic_tokens,), generator=g).to(dtype)
        files = stdlib_files() if self.corpus == "stdlib_text" else user_text_files(self.path or "")
        return read_text_corpus(files, self.max_bytes, key="data.path")

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = self.load_tokens()
        n_train = self.split(len(tokens), f"the corpus has only {len(tokens)} tokens; use a shorter seq_len.")
        self.train_set = PackedSequences(tokens[:n_train], self.seq_len)
        self.val_set = PackedSequences(tokens[n_train:], self.seq_len)

    @override
    def data_options(self) -> dict[str, Any]:
        """The options that decide which sequences the training set holds, saved with the loader's position."""
        options: dict[str, Any] = {"corpus": self.corpus, "seq_len": self.seq_len, "val_fraction": self.val_fraction}
        if self.corpus == "synthetic":
            options.update(synthetic_tokens=self.synthetic_tokens, vocab_size=self.vocab_size)
        else:
            options["max_bytes"] = self.max_bytes
        return options
