import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_trainopt.callbacks import SpeedMonitor
from lightning_trainopt.callbacks.speed_monitor import checkpointed_fraction
from lightning_trainopt.core.flops import transformer_flops
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import TINY, ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock


def _fit(monitor, clock, max_steps=5, **kwargs):
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=max_steps, logger=logger, **kwargs)
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    return logger


def test_exact_logged_values_with_mocked_clock_and_peak():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=1, clock=clock)
    logger = _fit(monitor, clock)
    flops = transformer_flops(TINY, 16, 4).train
    # Windows close at steps 2 and 4: one micro-batch (2 s) then two (4 s), 4 x 16 tokens each.
    assert logger.values("throughput/tokens_per_s") == [32.0, 32.0]
    assert logger.values("throughput/samples_per_s") == [2.0, 2.0]
    assert logger.values("throughput/tflops_per_s") == [flops / 2 / 1e12, 2 * flops / 4 / 1e12]
    assert logger.values("throughput/mfu") == [flops / 2 / 1e6, 2 * flops / 4 / 1e6]
    assert logger.values("throughput/hfu") == logger.values("throughput/mfu")
    s = monitor.summary()["throughput"]
    assert s["tokens"] == 3 * 64
    assert s["seconds"] == 6.0
    assert s["tokens_per_s"] == 32.0
    assert s["flops_source"] == "analytic transformer formula"
    assert s["peak_source"] == "user-set (peak_tflops)"


def test_gradient_accumulation_counts_every_micro_batch():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=1, clock=clock)
    logger = _fit(monitor, clock, max_steps=3, accumulate_grad_batches=2)
    # Two micro-batches of 64 tokens per optimizer step, each 2 s: 32 tokens/s, not 16 or 64.
    assert logger.values("throughput/tokens_per_s") == [32.0, 32.0]


def test_variable_length_batches():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    batches = [(torch.randint(0, 64, (4, t)), torch.randint(0, 64, (4, t))) for t in (8, 16, 8, 16)]
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=4, logger=logger)
    trainer.fit(tiny_module(), train_dataloaders=DataLoader(batches, batch_size=None))
    assert logger.values("throughput/tokens_per_s") == [(32 + 64) / 4.0, (32 + 64) / 4.0]
    flops = transformer_flops(TINY, 8, 4).train + transformer_flops(TINY, 16, 4).train
    assert logger.values("throughput/tflops_per_s") == [flops / 4 / 1e12] * 2


def test_no_peak_on_cpu_omits_mfu_with_one_note(caplog):
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, clock=clock)
    logger = _fit(monitor, clock, max_steps=3)
    assert logger.values("throughput/mfu") == []
    assert logger.values("throughput/tokens_per_s") == [64.0, 64.0]
    assert monitor.summary()["throughput"]["mfu"] is None


class Foreign(pl.LightningModule):
    """Not ours: no GPTConfig, so the meta-device flop counter is used."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, x):
        return self.head(self.embed(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_flop_counter_path_for_a_foreign_module():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, clock=clock, warmup_steps=0)
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(Foreign(), tiny_data(batch_size=4, seq_len=16))
    assert monitor.summary()["throughput"]["flops_source"] == "torch.utils.flop_counter on a meta copy"
    forward = 2 * 4 * 16 * 32 * 64
    # backward: the head's weight and input gradients (the embedding needs the latter), 2x forward.
    assert logger.values("throughput/tflops_per_s") == [3 * forward / 1e12] * 2


def test_checkpointed_fraction():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2))
    assert checkpointed_fraction(model, 2) == 0.5
    assert checkpointed_fraction(torch.nn.Linear(2, 2), 2) == 0.0


def test_hfu_counts_the_blocks_our_activation_checkpointing_recomputes():
    from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing

    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    logger = ListLogger()
    trainer = tiny_trainer(
        [ActivationCheckpointing(module_classes=["Block"], every_k=2), clock, monitor], max_steps=2, logger=logger
    )
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    f = transformer_flops(TINY, 16, 4)
    assert monitor.summary()["throughput"]["recompute_fraction"] == 0.5  # 1 of 2 blocks
    assert logger.values("throughput/mfu") == [f.train / 2 / 1e6] * 2
    assert logger.values("throughput/hfu") == [f.hardware_train(0.5) / 2 / 1e6] * 2


def test_bad_arguments():
    with pytest.raises(ConfigError, match="peak_tflops"):
        SpeedMonitor(peak_tflops=0)
    with pytest.raises(ConfigError, match="recompute_fraction"):
        SpeedMonitor(recompute_fraction=2.0)


@RunIf(min_cuda_gpus=1)
def test_mfu_on_gpu_is_a_true_fraction():
    monitor = SpeedMonitor(log_every_n_steps=2)
    trainer = tiny_trainer([monitor], max_steps=8, accelerator="gpu", precision="bf16-mixed")
    trainer.fit(tiny_module(), tiny_data(batch_size=8, seq_len=16))
    s = monitor.summary()["throughput"]
    assert s["dtype"] == "bf16"
    assert s["peak_tflops"] is not None, "the CUDA device should be in the peak table"
    assert 0.0 < s["mfu"] < 1.0
    assert s["tokens_per_s"] > 0
