"""Data: byte-level corpora and the packed-sequence data module."""

from lightning_trainopt.data.corpus import ByteTokenizer
from lightning_trainopt.data.datamodule import PackedSequences, TextDataModule

__all__ = ["ByteTokenizer", "PackedSequences", "TextDataModule"]
