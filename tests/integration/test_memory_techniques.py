"""Memory techniques in real single-device fits of the demo model (CPU)."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_trainopt.callbacks.activation_compression import ActivationCompression
from lightning_trainopt.data.datamodule import TextDataModule
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.lit_gpt import LitGPT

CFG = GPTConfig(name="it", vocab_size=256, n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, max_seq_len=64)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.values.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def _fit(
    callbacks: list[pl.Callback],
    steps: int,
    micro: int,
    accumulate: int = 1,
    corpus: str = "stdlib_text",
    lr: float = 3e-3,
    sgd: bool = False,
) -> Losses:
    pl.seed_everything(11)
    losses = Losses()
    optimizer = partial(torch.optim.SGD, lr=lr) if sgd else partial(torch.optim.AdamW, lr=lr)
    module = LitGPT(CFG, optimizer=optimizer)
    data = TextDataModule(
        corpus=corpus, seq_len=64, batch_size=micro, max_bytes=400_000, synthetic_tokens=65536, seed=11
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, losses],
    )
    trainer.fit(module, datamodule=data)
    return losses


def test_accumulating_four_micro_batches_equals_one_big_batch() -> None:
    big = _fit([], steps=1, micro=8, corpus="synthetic", sgd=True)
    accumulated = _fit([], steps=1, micro=2, accumulate=4, corpus="synthetic", sgd=True)
    assert big.grads.keys() == accumulated.grads.keys()
    assert big.grads
    for name, grad in big.grads.items():
        torch.testing.assert_close(accumulated.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


BASELINE_STEPS = 60


@pytest.fixture(scope="module")
def baseline() -> Losses:
    """60 steps on real text without any technique: the reference curve of the checkpointing and int8 runs.

    There is no schedule and the seed is the same, so its first 20 losses are those of a 20-step run.
    """
    return _fit([], steps=BASELINE_STEPS, micro=4)


def test_checkpointing_keeps_the_loss_curve_exactly(baseline: Losses) -> None:
    ckpt = _fit([ActivationCheckpointing()], steps=20, micro=4)
    assert ckpt.values == pytest.approx(baseline.values[:20], rel=1e-4)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="known regression, open: on this machine's current packages the int8 run's 10-step mean loss is 4.0% above "
    "the uncompressed run's at step 60 (1.9%, 2.4%, 2.5%, 4.0% over windows 3-6), deterministically and also at the "
    "last landed commit 0b3c8f0, where CI passed on 2026-12-02; bench/RESULTS.md 'int8 activations: loss curve "
    "(2026-12-05)'. strict: the test fails again as soon as the curve is back within 2%.",
)
def test_int8_loss_curve_stays_within_tolerance(baseline: Losses) -> None:
    """60 steps on real text: the int8 run's 10-step mean losses stay within 2% of the uncompressed run's.

    The longer run (300 steps of gpt_tiny) is in bench/memory_techniques.py --loss-steps 300.
    """
    int8 = _fit([ActivationCompression(min_numel=256)], steps=BASELINE_STEPS, micro=4)
    b, q = torch.tensor(baseline.values), torch.tensor(int8.values)
    assert b[-10:].mean() < 0.8 * b[:5].mean()  # it learned something, so the comparison means something
    window = 10
    smooth_b = b.unfold(0, window, window).mean(1)
    smooth_q = q.unfold(0, window, window).mean(1)
    rel = ((smooth_q - smooth_b).abs() / smooth_b).max().item()
    assert rel < 0.02, f"max relative gap of 10-step mean losses {rel:.4f}"
