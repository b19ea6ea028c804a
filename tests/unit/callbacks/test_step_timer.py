import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_trainopt.callbacks import StepTimer
from lightning_trainopt.callbacks.step_timer import split_marks
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.lit_gpt import LitGPT
from tests.helpers.tiny_fit import ListLogger, tiny_module, tiny_trainer


def test_split_marks_exact():
    marks = [
        ("batch_end", 0.0),
        ("h2d_start", 1.0),
        ("h2d_end", 1.5),
        ("batch_start", 2.0),
        ("before_backward", 3.0),
        ("after_backward", 5.0),
        ("before_optimizer_step", 5.5),
        ("batch_end", 6.0),
        ("pause", 6.5),
        ("resume", 9.5),
        ("batch_start", 10.0),
    ]
    s = split_marks(marks)
    assert s.seconds["data_wait"] == 1.5
    assert s.seconds["h2d"] == 0.5
    assert s.seconds["forward"] == 1.0
    assert s.seconds["backward"] == 2.0
    assert s.seconds["optimizer"] == 1.0
    assert s.wall == 7.0  # 10 s less the 3 s validation pause
    assert s.steps == 1


class SlowDataset(Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        x = torch.randint(0, 64, (16,))
        return x, x


def _fit(delay: float):
    timer = StepTimer(log_every_n_steps=2, warmup_steps=1)
    logger = ListLogger()
    trainer = tiny_trainer([timer], max_steps=5, logger=logger)
    trainer.fit(tiny_module(), train_dataloaders=DataLoader(SlowDataset(delay), batch_size=4))
    return timer, logger


def test_slow_dataset_is_input_bound():
    timer, logger = _fit(delay=0.25)
    s = timer.summary()["step_time"]
    assert s["verdict"] == "input-bound", s
    assert s["data_wait_frac"] > 0.3
    assert "raise data.num_workers from 0 to" in s["remedies"][0]
    fracs = logger.values("step_time/data_wait_frac")
    assert len(fracs) == 3
    assert all(f > 0.15 for f in fracs)
    total = sum(v for k, v in s.items() if k.endswith("_frac"))
    assert total == pytest.approx(1.0)


def test_fast_dataset_is_not_input_bound():
    # Indexing a pre-built tensor costs microseconds; a 4-layer, d=256 model over 8 x 128 tokens costs tens of
    # milliseconds per step even on a fast CPU, so the data share stays far under the 15% threshold on a busy
    # CI machine too (the 2-layer d=32 tiny model did not: its whole step is ~1 ms, comparable to collation).
    cfg = GPTConfig(name="compute", vocab_size=64, n_layers=4, d_model=256, n_heads=4, ffn_hidden=1024, max_seq_len=128)
    tokens = torch.randint(0, 64, (64, 128))
    timer = StepTimer(log_every_n_steps=2, warmup_steps=1)
    trainer = tiny_trainer([timer], max_steps=5)
    trainer.fit(LitGPT(cfg), train_dataloaders=DataLoader(TensorDataset(tokens, tokens), batch_size=8))
    s = timer.summary()["step_time"]
    assert s["verdict"] == "compute-bound", s
    assert s["data_wait_frac"] < 0.05, s
    assert s["forward_frac"] + s["backward_frac"] > 0.5


def test_state_dict_round_trip_and_bad_input():
    timer = StepTimer()
    timer._total.add("forward", 2.0)
    timer._total.wall, timer._total.steps = 4.0, 2
    other = StepTimer()
    other.load_state_dict(timer.state_dict())
    assert other.split.fractions() == timer.split.fractions()
    with pytest.raises(ConfigError, match="input_threshold"):
        StepTimer(input_threshold=1.5)
