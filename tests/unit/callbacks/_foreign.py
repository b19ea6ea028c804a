"""LightningModules that are not ours (no GPTConfig), written the ways users write them, for the monitors' tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

VOCAB, D = 50, 32


class DictClassifier(pl.LightningModule):
    """Hugging Face style: dict batches ``{input_ids, attention_mask, labels}`` with padding; ``forward`` takes the
    inputs as keywords and computes its own loss when given ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 2, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        pad = None if attention_mask is None else attention_mask == 0
        logits = self.head(self.enc(self.emb(input_ids), src_key_padding_mask=pad).mean(1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(**batch)["loss"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SelfCheckpointingClassifier(DictClassifier):
    """Hugging Face style ``gradient_checkpointing_enable()``: the encoder carries ``gradient_checkpointing = True``
    and its layers call ``torch.utils.checkpoint`` themselves while training (no wrapper anyone could detect)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc.gradient_checkpointing = True

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        pad = None if attention_mask is None else attention_mask == 0
        x = self.emb(input_ids)
        for layer in self.enc.layers:
            if self.enc.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, None, pad, use_reentrant=False)
            else:
                x = layer(x, src_key_padding_mask=pad)
        logits = self.head(x.mean(1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class TrimClassifier(DictClassifier):
    """Trims the padding with a data-dependent length: cannot run on meta tensors (they have no values)."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        assert attention_mask is not None
        t = int(attention_mask.sum(1).max())
        return super().forward(input_ids[:, :t], attention_mask[:, :t], labels)


class WholeBatchClassifier(DictClassifier):
    """``forward(batch)``: the whole dict goes in."""

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return super().forward(batch["input_ids"], batch["attention_mask"], batch["labels"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch)["loss"]


def padded_batches(n: int, batch_size: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` dict micro-batches padded to their longest row; lengths vary from row to row and batch to batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        t = 4 + (5 * k) % 13  # the padded length of this batch
        lengths = [t] + [max(1, t - 2 * j - k % 3) for j in range(1, batch_size)]
        ids = torch.zeros(batch_size, t, dtype=torch.long)
        mask = torch.zeros(batch_size, t, dtype=torch.long)
        for j, length in enumerate(lengths):
            ids[j, :length] = torch.randint(1, VOCAB, (length,), generator=g)
            mask[j, :length] = 1
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (batch_size,), generator=g)}
        )
    return out


def loader(batches: list[Any]) -> DataLoader:
    """The batches as they are, in order (no collation)."""
    return DataLoader(batches, batch_size=None)


class Batch:
    """A batch object the monitors cannot read (no tensor at the top level)."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.ids, self.labels = ids, labels


class ObjectBatchClassifier(DictClassifier):
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch.ids, None, batch.labels)["loss"]


def object_batches(n: int, batch_size: int = 4, seq_len: int = 6) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [
        Batch(
            torch.randint(0, VOCAB, (batch_size, seq_len), generator=g), torch.randint(0, 3, (batch_size,), generator=g)
        )
        for _ in range(n)
    ]


class TwoOptimizers(pl.LightningModule):
    """Manual optimization stepping two optimizers on every batch, so ``global_step`` advances by 2 a batch.

    Records each batch's learning rates of both optimizers in ``lrs``. Batches are ``(x,)`` with ``x`` of shape
    ``(B, width)`` (e.g. a ``TensorDataset`` of one tensor).
    """

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        self.lrs: list[tuple[float, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        body, head = self.optimizers()
        self.lrs.append((body.param_groups[0]["lr"], head.param_groups[0]["lr"]))
        loss = self.head(torch.relu(self.body(x))).pow(2).mean()
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(loss)
        body.step()
        head.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.AdamW(self.head.parameters(), lr=1e-3)]
