"""Data: byte-level corpora, prepared token shards, the packed-sequence data modules and their resumable loader."""

from lightning_trainopt.data.corpus import ByteTokenizer
from lightning_trainopt.data.datamodule import PackedSequences, TextDataModule
from lightning_trainopt.data.manifest import Manifest, Shard
from lightning_trainopt.data.packed_datamodule import PackedDataModule
from lightning_trainopt.data.packed_tokens import PackedTokens
from lightning_trainopt.data.prepare import prepare_corpus
from lightning_trainopt.data.resumable_loader import ResumableDataLoader
from lightning_trainopt.data.resumable_sampler import ResumableSampler
from lightning_trainopt.data.tokenized import TokenizedDataModule
from lightning_trainopt.data.tokenizer import TextTokenizer
from lightning_trainopt.data.tokenizer_sources import BpeTokenizer, LocalTokenizer

__all__ = [
    "BpeTokenizer",
    "ByteTokenizer",
    "LocalTokenizer",
    "Manifest",
    "PackedDataModule",
    "PackedSequences",
    "PackedTokens",
    "ResumableDataLoader",
    "ResumableSampler",
    "Shard",
    "TextDataModule",
    "TextTokenizer",
    "TokenizedDataModule",
    "prepare_corpus",
]
