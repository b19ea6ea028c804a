"""TokenizedDataModule: training on the token shards ``prepare.py`` writes (``data=tokenized data.path=DIR``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_trainopt.data.manifest import Manifest
from lightning_trainopt.data.packed_datamodule import PackedDataModule
from lightning_trainopt.data.packed_tokens import PackedTokens
from lightning_trainopt.exceptions import ConfigError

__all__ = ["TokenizedDataModule"]


class TokenizedDataModule(PackedDataModule):
    """Documents packed into fixed-length sequences, EOS between them, from a directory ``prepare.py`` wrote.

    The shards are read through NumPy memmaps (:class:`PackedTokens`), so a corpus larger than memory trains
    without being loaded. The last ``val_fraction`` of the token stream is the validation split (it never overlaps
    training). The loaders are :class:`PackedDataModule`'s: rank ``r`` of the data-parallel world (all nodes) reads
    its own share of one shuffled order per epoch, ranks never overlap, and a checkpoint saves the position in the
    epoch, so a run killed mid-epoch resumes on the very samples it would have read next.

    Args:
        path: the prepared directory (it holds ``manifest.json``).
        seq_len, batch_size, val_fraction, num_workers, pin_memory, prefetch_factor, persistent_workers, seed: as
            :class:`PackedDataModule` takes them.
        document_attention: attention stays inside each packed document (the model masks across the EOS ids; our
            GPT presets: ``model.attention``'s kernel with a document mask, or flash-attn's variable-length kernel).

    Attributes:
        vocab_size: token ids the model needs (the manifest's: the tokenizer's largest id + 1).
        eos_id: the id that ends every document.

    Raises:
        ConfigError: a bad value, or ``path`` holds no manifest ``prepare.py`` wrote.

    Example::

        dm = TokenizedDataModule("data/stdlib_bpe", seq_len=256, batch_size=8)
        model = MyModel(vocab_size=dm.vocab_size)
    """

    train_set: PackedTokens | None
    val_set: PackedTokens | None

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.02,
        num_workers: int = 0,
        pin_memory: bool = True,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        seed: int = 1234,
        document_attention: bool = False,
    ) -> None:
        super().__init__(
            seq_len, batch_size, val_fraction, num_workers, pin_memory, prefetch_factor, persistent_workers, seed
        )
        if not isinstance(document_attention, bool):
            raise ConfigError("data.document_attention", document_attention, "use true or false.")
        self.document_attention = document_attention
        if not isinstance(path, (str, Path)) or not str(path):
            raise ConfigError(
                "data.path", path, "data=tokenized needs data.path=DIR, a directory written by prepare.py."
            )
        self.path = str(path)
        self.directory = Path(path).expanduser()
        self.manifest = Manifest.read(self.directory, key="data.path")

    @property
    def vocab_size(self) -> int:
        return int(self.manifest.vocab_size or 0)

    @property
    def eos_id(self) -> int:
        return int(self.manifest.eos_id or 0)

    def _split(self) -> int:
        """Tokens of the training split; the rest is validation."""
        total = self.manifest.tokens
        return self.split(
            total,
            f"{self.path} holds {total} tokens, too few for a training and a validation sequence of {self.seq_len} "
            "tokens; use a shorter seq_len or prepare more text.",
        )

    def check_source(self) -> None:
        """Raise :class:`ConfigError` now if the preparation is unfinished, a shard is damaged, or too short."""
        self.manifest.check_shards(self.directory, key="data.path")
        self._split()

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.check_source()
        n_train = self._split()
        self.train_set = PackedTokens(self.directory, self.manifest, self.seq_len, 0, n_train)
        self.val_set = PackedTokens(self.directory, self.manifest, self.seq_len, n_train, self.manifest.tokens)

    @override
    def data_options(self) -> dict[str, Any]:
        """The options that decide which sequences the training set holds, saved with the loader's position."""
        return {"path": self.path, "seq_len": self.seq_len, "val_fraction": self.val_fraction}
