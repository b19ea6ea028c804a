"""LightningDataModule that packs a byte corpus into fixed-length next-token sequences."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_trainopt.data.corpus import read_text_corpus, stdlib_files, user_text_files
from lightning_trainopt.data.loader_options import check_loader_options, loader_kwargs
from lightning_trainopt.data.resumable_loader import ResumableDataLoader
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


class TextDataModule(pl.LightningDataModule):
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

    The training loader is a :class:`ResumableDataLoader`: it shards the data over the strategy's data-parallel
    ranks itself, and a checkpoint saves its position in the epoch, so a run killed mid-epoch resumes exactly.

    Example::

        dm = TextDataModule(corpus="synthetic", seq_len=64, batch_size=8)
    """

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
        super().__init__()
        if corpus not in ("stdlib_text", "text_file", "synthetic"):
            raise ConfigError("data.corpus", corpus, "use one of stdlib_text, text_file, synthetic.")
        for key, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"data.{key}", value, "use a positive integer.")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
            raise ConfigError("data.val_fraction", val_fraction, "use a fraction between 0 and 1.")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ConfigError("data.max_bytes", max_bytes, "use a positive number of bytes, or null to read all.")
        if corpus == "text_file" and not path:
            raise ConfigError("data.path", path, "data=text_file needs data.path=/path/to/file_or_folder.")
        check_loader_options(num_workers, pin_memory, prefetch_factor, persistent_workers)
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.path = path
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.synthetic_tokens = synthetic_tokens
        self.vocab_size = vocab_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.seed = seed
        self.train_set: PackedSequences | None = None
        self.val_set: PackedSequences | None = None

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
        n_val = max(self.seq_len + 1, int(len(tokens) * self.val_fraction))
        if len(tokens) - n_val < self.seq_len + 1:
            raise ConfigError(
                "data.seq_len", self.seq_len, f"the corpus has only {len(tokens)} tokens; use a shorter seq_len."
            )
        self.train_set = PackedSequences(tokens[:-n_val], self.seq_len)
        self.val_set = PackedSequences(tokens[-n_val:], self.seq_len)

    def _loader_kwargs(self) -> dict[str, Any]:
        return loader_kwargs(self.num_workers, self.pin_memory, self.prefetch_factor, self.persistent_workers)

    def data_options(self) -> dict[str, Any]:
        """The options that decide which sequences the training set holds, saved with the loader's position."""
        options: dict[str, Any] = {"corpus": self.corpus, "seq_len": self.seq_len, "val_fraction": self.val_fraction}
        if self.corpus == "synthetic":
            options.update(synthetic_tokens=self.synthetic_tokens, vocab_size=self.vocab_size)
        else:
            options["max_bytes"] = self.max_bytes
        return options

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        """A :class:`ResumableDataLoader` over the data-parallel ranks; a checkpoint saves its position."""
        assert self.train_set is not None
        sharding = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        return ResumableDataLoader(
            self.train_set,
            batch_size=self.batch_size,
            seed=self.seed,
            num_replicas=sharding.get("num_replicas", 1),
            rank=sharding.get("rank", 0),
            data_options=self.data_options(),
            # Worker seeds come from this generator, not from the global RNG (which the model may draw from).
            generator=torch.Generator().manual_seed(self.seed),
            **self._loader_kwargs(),
        )

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, **self._loader_kwargs())
