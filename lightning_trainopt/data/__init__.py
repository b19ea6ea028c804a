"""Data: byte-level corpora, the packed-sequence data module and its resumable training loader."""

from lightning_trainopt.data.corpus import ByteTokenizer
from lightning_trainopt.data.datamodule import PackedSequences, TextDataModule
from lightning_trainopt.data.resumable_loader import ResumableDataLoader
from lightning_trainopt.data.resumable_sampler import ResumableSampler

__all__ = ["ByteTokenizer", "PackedSequences", "ResumableDataLoader", "ResumableSampler", "TextDataModule"]
