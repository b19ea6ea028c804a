"""TextTokenizer: a local tokenizer (a ``tokenizer.json``, or a directory transformers reads) as ``prepare`` uses it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_trainopt.exceptions import ConfigError, MissingDependencyError

__all__ = ["EOS_CANDIDATES", "TextTokenizer", "hf_offline", "token_dtype"]

# End-of-document tokens of the common tokenizer families, tried in this order when none is named:
# GPT-2 / BPEs trained here, Llama 3, Llama 2 / T5 / Mistral, Gemma.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

# The files of a transformers tokenizer directory (its config names the tokenizer class and the special tokens).
_HF_DIR_MARKER = "tokenizer_config.json"


def hf_offline() -> None:
    """Put the Hugging Face libraries in offline mode, so a missing local file is an error and never a download.

    Set before ``datasets`` or ``transformers`` is imported (both read these variables when imported).
    """
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned NumPy dtype that holds every token id below ``vocab_size``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class TextTokenizer:
    """Text to token ids without special tokens added, with the id that ends a document.

    Wraps a ``tokenizers.Tokenizer`` (what ``tokenizer.json`` holds, and the backend of every fast transformers
    tokenizer) or, for a directory without one, a transformers tokenizer.

    Args:
        backend: a ``tokenizers.Tokenizer`` or a transformers ``PreTrainedTokenizerBase``.
        eos_token: the token appended after every document; it must be in the vocabulary.
        name: where it came from, for the manifest (a path, or ``bpe``).
        sha256: digest of the files it was read from (changes when the tokenizer does).
        key: the config key that names it, for errors.

    Raises:
        ConfigError: ``eos_token`` is not a token of this tokenizer.

    Example::

        tok = TextTokenizer.from_path("tokenizer.json")
        ids = tok.encode_batch(["def f(): pass"])[0] + [tok.eos_id]
    """

    def __init__(self, backend: Any, eos_token: str, name: str, sha256: str, key: str = "tokenizer.eos_token") -> None:
        self.backend = backend
        self.name = name
        self.sha256 = sha256
        vocab: dict[str, int] = backend.get_vocab()
        # The model needs an embedding row for the largest id, which can exceed the count of tokens (gaps in ids).
        self.vocab_size = max(vocab.values()) + 1
        eos_id = vocab.get(eos_token)
        if eos_id is None:
            raise ConfigError(
                key, eos_token, f"it is not a token of the tokenizer {name}; name its end-of-document token instead."
            )
        self.eos_token = eos_token
        self.eos_id = int(eos_id)
        # Fast transformers tokenizers are a tokenizers.Tokenizer underneath: encode with it directly (batched in Rust,
        # no warnings about documents longer than the model's context, which packing splits anyway).
        self._fast = backend if hasattr(backend, "encode_batch") else getattr(backend, "backend_tokenizer", None)
        if self._fast is not None:
            # The text of a special token inside a document (code that mentions "<|endoftext|>") is text: encoded as
            # its characters, so that the only EOS ids in a shard are the ones that end documents.
            self._fast.encode_special_tokens = True

    @classmethod
    def from_path(cls, path: str | Path, eos_token: str | None = None, key: str = "tokenizer.path") -> TextTokenizer:
        """Load a local tokenizer: a ``tokenizer.json`` file, or a directory holding one or a transformers tokenizer.

        Nothing is downloaded: a path that does not exist (a Hub name, say) is refused.

        Args:
            path: the file or directory.
            eos_token: the end-of-document token; ``None``: the tokenizer's own (transformers) or the first of
                :data:`EOS_CANDIDATES` it has.
            key: the config key of ``path``, for errors.

        Raises:
            ConfigError: the path does not exist, holds no tokenizer, or the tokenizer has no known end token.
        """
        where = Path(path).expanduser()
        if not where.exists():
            raise ConfigError(
                key,
                str(path),
                "no such file or directory, and prepare never downloads: give a local tokenizer.json or a directory "
                "holding one (save a Hub tokenizer with AutoTokenizer.from_pretrained(...).save_pretrained(DIR) on a "
                "machine with access).",
            )
        eos_key = key.rpartition(".")[0] + ".eos_token" if "." in key else "eos_token"
        if where.is_dir() and (where / _HF_DIR_MARKER).is_file():
            backend = _load_transformers(where, key)
            files = sorted(p for p in where.iterdir() if p.is_file())
            eos = eos_token or backend.eos_token or _known_eos(backend.get_vocab(), str(where), eos_key)
        else:
            file = where / "tokenizer.json" if where.is_dir() else where
            if not file.is_file():
                raise ConfigError(
                    key, str(path), "the directory holds neither tokenizer.json nor tokenizer_config.json; give one."
                )
            backend = _load_tokenizers(file, key)
            files = [file]
            eos = eos_token or _known_eos(backend.get_vocab(), str(file), eos_key)
        return cls(backend, eos, name=str(where.resolve()), sha256=_digest(files), key=eos_key)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, with no special tokens added (no BOS; the caller appends :attr:`eos_id`).

        A special token's text inside a document is encoded as ordinary text, never as that token.
        """
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]
        encoded = self.backend(list(texts), add_special_tokens=False, split_special_tokens=True, verbose=False)
        return list(encoded["input_ids"])


def _known_eos(vocab: dict[str, int], name: str, key: str) -> str:
    for token in EOS_CANDIDATES:
        if token in vocab:
            return token
    raise ConfigError(
        key,
        None,
        f"the tokenizer {name} has none of the usual end-of-document tokens ({', '.join(EOS_CANDIDATES)}); name its "
        f"own, e.g. {key}='<|im_end|>'.",
    )


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _load_tokenizers(file: Path, key: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise MissingDependencyError("tokenizers", "data", "A local tokenizer.json") from err
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ConfigError(key, str(file), f"it is not a tokenizers tokenizer.json ({err}); give one.") from err


def _load_transformers(directory: Path, key: str) -> Any:
    hf_offline()
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise MissingDependencyError("transformers", "hf", "A transformers tokenizer directory") from err
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(
            key, str(directory), f"transformers cannot load a tokenizer from it offline ({err}); give a complete one."
        ) from err
