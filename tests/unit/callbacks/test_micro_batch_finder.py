from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_trainopt.callbacks.micro_batch_finder import MicroBatchFinder
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer


class BatchSizes(pl.Callback):
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.accumulate: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.sizes.append(int(batch[0].shape[0]))
        self.accumulate.append(trainer.accumulate_grad_batches)


def _fit(finder: MicroBatchFinder, batch_size: int = 8, accumulate: int = 1, steps: int = 1) -> BatchSizes:
    seen = BatchSizes()
    torch.manual_seed(0)
    trainer = tiny_trainer([finder, seen], max_steps=steps, accumulate_grad_batches=accumulate)
    trainer.fit(tiny_module(), datamodule=tiny_data(batch_size=batch_size))
    assert trainer.global_step == steps
    return seen


def test_budget_picks_micro_batch_and_keeps_global_batch() -> None:
    roomy = MicroBatchFinder(budget_bytes=2**40)
    seen = _fit(roomy)
    assert roomy.plan is not None
    assert roomy.plan.micro_batch == 8
    assert seen.sizes == [8]
    per_sample, fixed = roomy.plan.per_sample_bytes, roomy.plan.fixed_bytes
    assert per_sample > 0
    assert fixed > 0

    tight = MicroBatchFinder(budget_bytes=fixed + 2 * per_sample + per_sample // 2)
    seen = _fit(tight)
    assert tight.plan is not None
    assert (tight.plan.micro_batch, tight.plan.accumulate, tight.plan.global_batch) == (2, 4, 8)
    assert seen.sizes == [2, 2, 2, 2]
    assert seen.accumulate == [4, 4, 4, 4]
    assert tight.summary()["micro_batch_finder"]["global_batch"] == 8


def test_user_accumulation_counts_in_the_global_batch() -> None:
    finder = MicroBatchFinder(budget_bytes=2**40, max_micro_batch=8)
    seen = _fit(finder, batch_size=4, accumulate=4)
    assert finder.plan is not None
    assert (finder.plan.micro_batch, finder.plan.accumulate) == (8, 2)
    assert seen.sizes == [8, 8]


def test_refuses_on_cpu_without_budget() -> None:
    with pytest.raises(ConfigError, match="callbacks.micro_batch_finder.budget_bytes=None") as err:
        _fit(MicroBatchFinder())
    assert "budget_bytes=4e9" in str(err.value)


def test_refuses_when_nothing_fits() -> None:
    with pytest.raises(ConfigError, match="even a micro-batch of 1"):
        _fit(MicroBatchFinder(budget_bytes=1000))


def test_arguments_validated() -> None:
    with pytest.raises(ConfigError, match="budget_fraction"):
        MicroBatchFinder(budget_fraction=1.5)
    with pytest.raises(ConfigError, match="max_micro_batch"):
        MicroBatchFinder(budget_bytes=1, max_micro_batch=0)
    with pytest.raises(ConfigError, match="batch_arg_name"):
        _fit(MicroBatchFinder(budget_bytes=2**40, batch_arg_name="micro"))


@RunIf(min_cuda_gpus=1)
def test_cuda_trials_step_down_on_a_real_out_of_memory() -> None:
    """A budget far above what the allocator may really hand out (capped with set_per_process_memory_fraction) makes
    the plan too big; the trial forward/backward must hit a real ``torch.OutOfMemoryError``, step down through the
    divisors, and train at the largest micro-batch that ran, with the global batch kept."""
    from lightning_trainopt.data.datamodule import TextDataModule
    from lightning_trainopt.models.config import GPTConfig
    from lightning_trainopt.models.lit_gpt import LitGPT

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 4 * 2**30  # ~84 MB saved per sample at 512 x 512 x 4 layers: 512 samples want ~43 GB, 32 fit
    cfg = GPTConfig(name="oom", vocab_size=64, n_layers=4, d_model=512, n_heads=8, ffn_hidden=1408, max_seq_len=512)
    data = TextDataModule(
        corpus="synthetic", seq_len=512, batch_size=512, vocab_size=64, synthetic_tokens=600 * 513, seed=0
    )
    finder = MicroBatchFinder(budget_bytes=total)  # the plan believes the whole device is available
    seen = BatchSizes()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        trainer = tiny_trainer([finder, seen], max_steps=1, accelerator="gpu", devices=1)
        trainer.fit(LitGPT(cfg), datamodule=data)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    assert finder.plan is not None
    fits = [t["fits"] for t in finder.trials]
    assert len(fits) >= 2, finder.trials
    assert fits == [False] * (len(fits) - 1) + [True], finder.trials
    micro = finder.plan.micro_batch
    assert micro == finder.trials[-1]["micro_batch"] < 512
    assert finder.plan.global_batch == 512 == micro * finder.plan.accumulate
    assert set(seen.sizes) == {micro}
    assert len(seen.sizes) == finder.plan.accumulate
    assert trainer.global_step == 1
