"""Where ``prepare`` gets its tokenizer: a BPE trained on the corpus itself, or a local one (``conf/tokenizer/``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from lightning_trainopt.data.tokenizer import TextTokenizer
from lightning_trainopt.exceptions import ConfigError, MissingDependencyError

__all__ = ["MIN_BPE_VOCAB", "BpeTokenizer", "LocalTokenizer", "TokenizerSource"]

# A byte-level BPE starts from the 256 byte symbols, plus its end-of-document token; the merges come on top.
MIN_BPE_VOCAB = 257

TOKENIZER_FILE = "tokenizer.json"


class TokenizerSource(Protocol):
    """What :func:`~lightning_trainopt.data.prepare.prepare_corpus` needs of a ``tokenizer`` config node."""

    def identity(self) -> dict[str, Any]:
        """What decides the token ids (a changed identity means other shards). Raises ConfigError if unusable."""
        ...

    def build(self, output: Path, documents: Callable[[], Iterable[str]]) -> TextTokenizer:
        """The tokenizer, trained on ``documents()`` and saved into ``output`` if it must be."""
        ...


def _positive_int(key: str, value: Any, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, fix)


def _token(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "use a non-empty token string, e.g. '<|endoftext|>'.")


class BpeTokenizer:
    """A byte-level BPE trained with ``tokenizers`` on the corpus being prepared, saved as ``tokenizer.json``.

    Byte-level: every text encodes (no unknown token), the first 256 ids after the special token are the bytes.
    Training reads every document once before encoding; for a corpus too large for that, train a tokenizer on a
    sample and use ``tokenizer=local``.

    Args:
        vocab_size: ids in the vocabulary, at least :data:`MIN_BPE_VOCAB` (256 bytes + ``eos_token``). A corpus with
            fewer distinct merges yields a smaller vocabulary; the manifest records the one trained.
        eos_token: the end-of-document token (id 0).
        min_frequency: a pair merges only if it occurs at least this often.

    Raises:
        ConfigError: a value out of range.

    Example::

        tok = BpeTokenizer(vocab_size=512).build(Path("out"), lambda: ["some text", "more text"])
    """

    def __init__(self, vocab_size: int = 8192, eos_token: str = "<|endoftext|>", min_frequency: int = 2) -> None:
        _positive_int(
            "tokenizer.vocab_size",
            vocab_size,
            MIN_BPE_VOCAB,
            f"a byte-level BPE needs at least {MIN_BPE_VOCAB} ids (256 bytes + the end-of-document token); use e.g. "
            "tokenizer.vocab_size=8192.",
        )
        if vocab_size > 2**32:
            raise ConfigError("tokenizer.vocab_size", vocab_size, "token ids are stored as uint32; use at most 2**32.")
        _token("tokenizer.eos_token", eos_token)
        _positive_int("tokenizer.min_frequency", min_frequency, 1, "use a positive count, e.g. 2.")
        self.vocab_size = vocab_size
        self.eos_token = eos_token
        self.min_frequency = min_frequency

    def identity(self) -> dict[str, Any]:
        return {
            "kind": "bpe",
            "vocab_size": self.vocab_size,
            "eos_token": self.eos_token,
            "min_frequency": self.min_frequency,
        }

    def build(self, output: Path, documents: Callable[[], Iterable[str]]) -> TextTokenizer:
        """Train on ``documents()`` and save ``output/tokenizer.json``; load that file instead if it is there.

        The caller decides that a ``tokenizer.json`` already in ``output`` belongs to this corpus (the manifest's
        fingerprint); training again would cost a pass over the corpus.
        """
        file = output / TOKENIZER_FILE
        if not file.is_file():
            backend = self._train(documents())
            partial = file.with_name(file.name + ".tmp")
            backend.save(str(partial))
            os.replace(partial, file)
        return TextTokenizer.from_path(file, self.eos_token, key="tokenizer.path")

    def _train(self, texts: Iterable[str]) -> Any:
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError as err:
            raise MissingDependencyError("tokenizers", "data", "tokenizer=bpe") from err
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=self.vocab_size,
            min_frequency=self.min_frequency,
            special_tokens=[self.eos_token],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        return backend


class LocalTokenizer:
    """A tokenizer on local disk: a ``tokenizer.json``, or a directory holding one or a transformers tokenizer.

    Never downloaded: the Hugging Face libraries run offline, and a path that does not exist (a Hub name) is refused.

    Args:
        path: the file or directory (``tokenizer.path=...``; required).
        eos_token: the token appended after each document; ``None``: the tokenizer's own end token.

    Raises:
        ConfigError: ``path`` missing, or ``eos_token`` not a string.

    Example::

        tok = LocalTokenizer("/models/llama/tokenizer.json").build(Path("out"), lambda: [])
    """

    def __init__(self, path: str | None = None, eos_token: str | None = None) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError(
                "tokenizer.path",
                path,
                "tokenizer=local needs tokenizer.path=/path/to/tokenizer.json (or its directory).",
            )
        if eos_token is not None:
            _token("tokenizer.eos_token", eos_token)
        self.path = path
        self.eos_token = eos_token
        self._loaded: TextTokenizer | None = None

    def _load(self) -> TextTokenizer:
        if self._loaded is None:
            self._loaded = TextTokenizer.from_path(self.path, self.eos_token, key="tokenizer.path")
        return self._loaded

    def identity(self) -> dict[str, Any]:
        tok = self._load()
        return {"kind": "local", "path": tok.name, "eos_token": tok.eos_token, "sha256": tok.sha256}

    def build(self, output: Path, documents: Callable[[], Iterable[str]]) -> TextTokenizer:
        return self._load()
