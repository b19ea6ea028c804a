import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_trainopt.callbacks.step_timer as step_timer_module
from lightning_trainopt.callbacks import StepTimer
from lightning_trainopt.callbacks._comm_probe import CommProbe, _HookState, attach_comm_probe, timed_allreduce_hook
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.lit_gpt import LitGPT
from tests.helpers.tiny_fit import ListLogger, tiny_module, tiny_trainer


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


class Ticker:
    """A clock that advances one second at every reading, so each StepTimer mark lands one second after the last."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


class MarksInBackward(pl.LightningModule):
    """Calls the probe's mark during backward, as StepTimer's DDP hook does when the last bucket is handed over."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.mark: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        loss.register_hook(lambda grad: (self.mark(), grad)[1])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fake_probe_fit(monkeypatch, probe: bool):
    module = MarksInBackward()

    def fake_attach(model, world_size, mark):
        module.mark = mark if probe else (lambda: None)
        return (CommProbe("fake_probe", lambda: None), None) if probe else (None, "no probe for this strategy")

    monkeypatch.setattr(step_timer_module, "attach_comm_probe", fake_attach)
    timer = StepTimer(log_every_n_steps=1, warmup_steps=1, clock=Ticker())
    logger = ListLogger()
    trainer = tiny_trainer([timer], max_steps=3, logger=logger)
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    return timer.summary()["step_time"], logger


def test_probe_mark_moves_the_wait_from_backward_to_comm(monkeypatch):
    # Marks per step, one tick apart: h2d_start, h2d_end, batch_start, before_backward, grads_ready, after_backward,
    # before_optimizer_step, batch_end -> 8 s: data wait 2, copy 1, forward 1, backward 1, comm 1, optimizer 2.
    s, logger = _fake_probe_fit(monkeypatch, probe=True)
    assert logger.values("step_time/comm_frac") == [0.125, 0.125]
    assert logger.values("step_time/backward_frac") == [0.125, 0.125]
    assert logger.values("step_time/step_s") == [8.0, 8.0]
    assert s["comm_measured"] is True
    assert s["comm_probe"] == "fake_probe"
    assert s["comm_note"] is None
    assert (s["data_wait_frac"], s["h2d_frac"], s["forward_frac"], s["optimizer_frac"]) == (0.25, 0.125, 0.125, 0.25)
    assert s["other_frac"] == 0.0


def test_without_probe_comm_is_absent_and_the_note_says_why(monkeypatch):
    s, logger = _fake_probe_fit(monkeypatch, probe=False)
    assert logger.values("step_time/comm_frac") == []
    assert logger.values("step_time/backward_frac") == [1 / 7, 1 / 7]  # 7 marks a step: no grads_ready
    assert "comm_frac" not in s
    assert s["comm_measured"] is False
    assert s["comm_probe"] is None
    assert s["comm_note"] == "no probe for this strategy"


class FakeBucket:
    def __init__(self, last: bool) -> None:
        self.last = last

    def is_last(self) -> bool:
        return self.last


def test_timed_hook_marks_only_the_last_bucket_and_returns_the_allreduce(monkeypatch):
    calls: list[tuple[Any, Any]] = []
    sentinel = object()

    def fake_allreduce(process_group, bucket):
        calls.append((process_group, bucket))
        return sentinel

    monkeypatch.setattr(default_hooks, "allreduce_hook", fake_allreduce)
    marks: list[int] = []
    state = _HookState(process_group="pg", mark=lambda: marks.append(1))
    first, last = FakeBucket(False), FakeBucket(True)
    assert timed_allreduce_hook(state, first) is sentinel
    assert marks == []
    assert timed_allreduce_hook(state, last) is sentinel
    assert marks == [1]
    state.active = False  # detached: still reduces, no longer marks
    assert timed_allreduce_hook(state, last) is sentinel
    assert marks == [1]
    assert calls == [("pg", first), ("pg", last), ("pg", last)]


def test_no_probe_without_ddp():
    module = torch.nn.Linear(2, 2)
    assert attach_comm_probe(module, 1, lambda: None) == (None, None)  # one process: nothing to communicate
    probe, why = attach_comm_probe(module, 2, lambda: None)
    assert probe is None
    assert "measured under DDP only, not for Linear" in why
