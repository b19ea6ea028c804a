"""Through Lightning's own save and restore: a fit resumed mid-epoch reads what an uninterrupted fit read.

One uninterrupted fit per accumulation setting saves a checkpoint after every optimizer step and records the
sequences of every micro-batch; fits resumed from some of those checkpoints must record the same micro-batches for
the steps after theirs. The corpus holds 16 micro-batches per epoch, so the runs cross several epochs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_trainopt.data import TextDataModule

MAX_STEPS = 40


class Recorder(pl.LightningModule):
    """Records ``(global step, epoch, first tokens of each sequence)`` per micro-batch; learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, int, list[tuple[int, ...]]]] = []

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        self.seen.append((self.trainer.global_step, self.trainer.current_epoch, [tuple(r[:4].tolist()) for r in x]))
        return (self.weight * x.float().mean()).sum()

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(accumulate: int, ckpt_dir: Path, ckpt_path: Path | None = None) -> tuple[Recorder, list[str]]:
    data = TextDataModule(
        corpus="synthetic", seq_len=8, batch_size=2, synthetic_tokens=300, vocab_size=64, val_fraction=0.1, seed=3
    )
    module = Recorder()
    saving = ckpt_path is None
    callbacks = (
        [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)] if saving else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=MAX_STEPS,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=saving,
        callbacks=callbacks,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``accumulate -> (checkpoint dir, recorded micro-batches)`` of one uninterrupted fit each, made on first use."""
    runs: dict[int, tuple[Path, list]] = {}

    def run(accumulate: int) -> tuple[Path, list]:
        if accumulate not in runs:
            ckpt_dir = tmp_path_factory.mktemp(f"accumulate{accumulate}")
            runs[accumulate] = ckpt_dir, _fit(accumulate, ckpt_dir)[0].seen
        return runs[accumulate]

    return run


# 16 micro-batches per epoch. Without accumulation: step 8 is the middle of epoch 0, 16 its last batch, 20 the middle
# of epoch 1. With 3: an epoch is 5 full steps and one of a single micro-batch; step 6 ends epoch 0, step 8 is
# micro-batch 6 of epoch 1.
@pytest.mark.parametrize(("accumulate", "stop"), [(1, 8), (1, 16), (1, 20), (3, 6), (3, 8)])
def test_a_fit_resumed_mid_epoch_reads_what_the_uninterrupted_fit_read(uninterrupted, accumulate, stop):
    ckpt_dir, seen = uninterrupted(accumulate)
    resumed, messages = _fit(accumulate, ckpt_dir, ckpt_path=ckpt_dir / f"step={stop}.ckpt")
    expected = [record for record in seen if record[0] >= stop]
    assert 0 < len(expected) < len(seen)
    assert resumed.seen == expected
    assert not [m for m in messages if "not resumable" in m]
    assert len({epoch for _, epoch, _ in expected}) > 1  # the rest crosses an epoch boundary


def test_overfit_batches_reads_the_first_batches_in_order():
    """Lightning rebuilds the loader with a SequentialSampler for ``overfit_batches``: it reads without shuffling."""
    module = Recorder()
    data = TextDataModule(corpus="synthetic", seq_len=8, batch_size=2, synthetic_tokens=300, vocab_size=64)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        overfit_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, datamodule=data)
    data.setup()
    first = [
        [tuple(data.train_set[i][0][:4].tolist()) for i in (0, 1)],
        [tuple(data.train_set[i][0][:4].tolist()) for i in (2, 3)],
    ]
    assert [batch for _, _, batch in module.seen] == first * 2
