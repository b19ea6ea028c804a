"""A user's own LightningModule and LightningDataModule, importable by ``_target_`` (``model=module``,
``data=datamodule``): nothing in them knows about lightning_trainopt.

:class:`UserLM` is a small causal transformer built from torch modules in ``__init__`` (its blocks an
``nn.ModuleList``), fed dict batches ``{input_ids, attention_mask, labels}`` padded on the right (labels -100 on the
padding); it has no ``configure_optimizers``, so the app's ``optimizer``/``scheduler`` groups apply.
:class:`UserLMWithOptimizer` has its own (SGD), which the app keeps. :class:`PaddedTokens` makes the padded batches:
rows of 8 to ``seq_len`` random tokens, its micro-batch read from ``self.batch_size`` (a MicroBatchFinder sets it).
:class:`TrainOnlyLM` and :class:`PaddedTrainTokens` are the same without any validation (no ``validation_step``, no
``val_dataloader``), as many users' first modules are.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["PaddedTokens", "PaddedTrainTokens", "TrainOnlyLM", "UserLM", "UserLMWithOptimizer"]

IGNORE = -100


class TrainOnlyLM(pl.LightningModule):
    """A causal transformer LM: embedding, ``n_layers`` pre-norm encoder layers under a causal mask, a head.

    It only trains: no ``validation_step``.
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 32, n_layers: int = 2, n_heads: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 2 * d_model, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers)
        )
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        causal = torch.triu(torch.full((t, t), float("-inf"), device=input_ids.device), diagonal=1)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        return self.head(x)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        return nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, batch_size=batch["input_ids"].shape[0])
        return loss


class UserLM(TrainOnlyLM):
    """:class:`TrainOnlyLM` with a ``validation_step`` that logs ``val_loss``."""

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True, batch_size=batch["input_ids"].shape[0])


class UserLMWithOptimizer(UserLM):
    """:class:`UserLM` with its own optimizer: plain SGD at ``lr``."""

    def __init__(self, lr: float = 0.05, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _Rows(Dataset):
    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(8, seq_len + 1, (n,), generator=g)
        self.tokens = torch.randint(0, vocab_size, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i, : int(self.lengths[i])]


def _pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


class PaddedTrainTokens(pl.LightningDataModule):
    """Random token rows of varying length, padded per batch on the right; a train loader only."""

    def __init__(self, batch_size: int = 4, seq_len: int = 32, vocab_size: int = 256, n_rows: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.n_rows = n_rows

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            _Rows(self.n_rows, self.seq_len, self.vocab_size, 0), batch_size=self.batch_size, collate_fn=_pad
        )


class PaddedTokens(PaddedTrainTokens):
    """:class:`PaddedTrainTokens` with a validation loader of 16 other rows."""

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Rows(16, self.seq_len, self.vocab_size, 1), batch_size=self.batch_size, collate_fn=_pad)
