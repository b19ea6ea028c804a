"""SpeedMonitor's HFU at a given recompute fraction strictly between 0 and 1.

Recomputing a fraction ``r`` of the forward adds ``r x forward = r / 3 x (forward + backward)`` FLOPs: HFU counts
``model FLOPs x (1 + r / 3)``. The other tests only gave ``r = 0``, where ``1 + r`` and ``1 + r / 3`` agree.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_trainopt.callbacks import SpeedMonitor
from tests.helpers.tiny_fit import ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock


class _Foreign(pl.LightningModule):
    """Not ours (no GPTConfig): its FLOPs come from the meta-device flop counter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("recompute", "hfu"), [(0.5, 1.75), (1.0, 2.0)])
def test_hfu_of_a_given_recompute_fraction_with_a_flops_function(recompute, hfu):
    # 3e6 model FLOPs per micro-batch, 2 s per micro-batch, a 1e6 FLOP/s peak: MFU 1.5. Half the forward recomputed:
    # 3e6 x (1 + 0.5 / 3) = 3.5e6 executed, HFU 1.75; all of it: 3e6 x 4/3 = 4e6, HFU 2.0.
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(
        log_every_n_steps=1,
        peak_tflops=1e-6,
        warmup_steps=0,
        clock=clock,
        flops_per_batch_fn=lambda batch: 3_000_000,
        recompute_fraction=recompute,
    )
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(tiny_module(), tiny_data(batch_size=4))
    assert logger.values("throughput/mfu") == [1.5, 1.5]
    assert logger.values("throughput/hfu") == [hfu, hfu]
    s = monitor.summary()["throughput"]
    assert (s["mfu"], s["hfu"], s["recompute_fraction"]) == (1.5, hfu, recompute)


def test_hfu_of_a_given_recompute_fraction_on_the_flop_counter_path():
    # Embedding + a 32 -> 64 head over 4 x 16 tokens: forward 2 x 64 x 32 x 64 = 262,144 FLOPs, backward twice that
    # (the head's weight and input gradients): 786,432 model FLOPs per micro-batch, 1 s each on a 1e6 FLOP/s peak.
    # A quarter of the forward recomputed: 786,432 x (1 + 0.25 / 3) = 851,968 executed.
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock, recompute_fraction=0.25)
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(_Foreign(), tiny_data(batch_size=4, seq_len=16))
    assert monitor.summary()["throughput"]["flops_source"] == "torch.utils.flop_counter on a meta copy"
    assert logger.values("throughput/mfu") == pytest.approx([0.786432] * 2, rel=1e-12)
    assert logger.values("throughput/hfu") == pytest.approx([0.851968] * 2, rel=1e-12)
