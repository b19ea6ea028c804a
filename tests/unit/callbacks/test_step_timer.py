import time
from functools import partial
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.compile import from_compiled
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_trainopt.callbacks.step_timer as step_timer_module
from lightning_trainopt._compat.torch_internals import is_compiled
from lightning_trainopt.callbacks import StepTimer
from lightning_trainopt.callbacks._comm_probe import CommProbe, _HookState, attach_comm_probe, timed_allreduce_hook
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.lit_gpt import LitGPT
from tests.helpers.tiny_fit import ListLogger, tiny_data, tiny_module, tiny_trainer


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
    timer, logger = _fit(delay=0.15)  # 0.6 s to read a batch of 4; the tiny model steps in 5-700 ms on a busy host
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
    # Indexing a pre-built tensor and collating 8 x 96 tokens costs well under a millisecond; a 2-layer, d=192 model
    # over those tokens costs tens of milliseconds per step on these CPUs (0.5-1% data wait measured), so the data
    # share stays far under the 15% threshold on a busy CI machine too. SGD keeps the optimizer step (AdamW's took
    # 30% of a step on a loaded host) from deciding the verdict.
    cfg = GPTConfig(name="compute", vocab_size=64, n_layers=2, d_model=192, n_heads=4, ffn_hidden=768, max_seq_len=96)
    tokens = torch.randint(0, 64, (64, 96))
    timer = StepTimer(log_every_n_steps=2, warmup_steps=1)
    trainer = tiny_trainer([timer], max_steps=5)
    module = LitGPT(cfg, optimizer=partial(torch.optim.SGD, lr=0.01))
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(tokens, tokens), batch_size=8))
    s = timer.summary()["step_time"]
    assert s["verdict"] == "compute-bound", s
    assert s["fetch_timed"] is True
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
    # Marks per step, one tick apart: fetch_start, fetch_end, h2d_start, h2d_end, batch_start, before_backward,
    # grads_ready, after_backward, before_optimizer_step, batch_end -> 10 s: data wait (the fetch) 1, copy 1,
    # forward 1, backward 1, comm 1, optimizer 2, and 3 in no phase (batch_end -> fetch_start, fetch_end -> h2d_start,
    # h2d_end -> batch_start: the loop's own work between steps).
    s, logger = _fake_probe_fit(monkeypatch, probe=True)
    assert logger.values("step_time/comm_frac") == [0.1, 0.1]
    assert logger.values("step_time/backward_frac") == [0.1, 0.1]
    assert logger.values("step_time/step_s") == [10.0, 10.0]
    assert s["comm_measured"] is True
    assert s["comm_probe"] == "fake_probe"
    assert s["comm_note"] is None
    assert s["fetch_timed"] is True
    assert (s["data_wait_frac"], s["h2d_frac"], s["forward_frac"], s["optimizer_frac"]) == (0.1, 0.1, 0.1, 0.2)
    assert s["other_frac"] == pytest.approx(0.3)


def test_without_probe_comm_is_absent_and_the_note_says_why(monkeypatch):
    s, logger = _fake_probe_fit(monkeypatch, probe=False)
    assert logger.values("step_time/comm_frac") == []
    assert logger.values("step_time/backward_frac") == [1 / 9, 1 / 9]  # 9 marks a step: no grads_ready
    assert "comm_frac" not in s
    assert s["comm_measured"] is False
    assert s["comm_probe"] is None
    assert s["comm_note"] == "no probe for this strategy"


class ClockDataset(Dataset):
    """Each item read advances the fake clock by ``cost`` seconds (a dataset that takes that long)."""

    def __init__(self, clock: Ticker, cost: float) -> None:
        self.clock, self.cost = clock, cost

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        self.clock.t += self.cost
        return torch.randn(4)


class SlowBatchEnd(pl.Callback):
    """Advances the fake clock by ``cost`` seconds in ``on_train_batch_end`` (a checkpoint save, a slow callback)."""

    def __init__(self, clock: Ticker, cost: float) -> None:
        self.clock, self.cost = clock, cost

    def on_train_batch_end(self, *args: Any) -> None:
        self.clock.t += self.cost


class Linear4(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _ticker_fit(item_cost: float, batch_end_cost: float):
    clock = Ticker()
    timer = StepTimer(log_every_n_steps=1, warmup_steps=1, clock=clock)
    logger = ListLogger()
    # Lightning calls callbacks in list order: the slow one runs after StepTimer's batch_end mark, between steps.
    trainer = tiny_trainer([timer, SlowBatchEnd(clock, batch_end_cost)], max_steps=3, logger=logger)
    trainer.fit(Linear4(), train_dataloaders=DataLoader(ClockDataset(clock, item_cost), batch_size=2))
    return timer.summary()["step_time"], logger


def test_time_between_steps_is_other_and_only_the_fetch_is_data_wait():
    # A checkpoint saved between steps is not input-bound. Per step: 9 marks one tick apart (fetch_start,
    # fetch_end, h2d_start, h2d_end, batch_start, before_backward, after_backward, before_optimizer_step, batch_end)
    # plus 10 s in a callback after batch_end (fast data: reading items costs nothing) -> 19 s: fetch 1, copy 1,
    # forward 1, backward 1, optimizer 2, and 13 in no phase (11 after batch_end, 1 after the fetch, 1 after the copy).
    s, logger = _ticker_fit(item_cost=0.0, batch_end_cost=10.0)
    assert logger.values("step_time/step_s") == [19.0, 19.0]
    assert logger.values("step_time/data_wait_frac") == [1 / 19, 1 / 19]
    assert logger.values("step_time/other_frac") == pytest.approx([13 / 19, 13 / 19])
    assert s["verdict"] == "overhead-bound", s
    assert "68% of wall time is outside data, copy, compute and optimizer" in s["reason"]
    assert any("checkpoints less often" in r for r in s["remedies"])


def test_a_slow_fetch_is_data_wait():
    # The same loop with the 10 s spent reading the batch (2 items x 5 s) instead: that is input, not overhead.
    # The fetch is 1 + 10 s; the 3 ticks between the phases stay in no phase.
    s, logger = _ticker_fit(item_cost=5.0, batch_end_cost=0.0)
    assert logger.values("step_time/step_s") == [19.0, 19.0]
    assert logger.values("step_time/data_wait_frac") == [11 / 19, 11 / 19]
    assert logger.values("step_time/other_frac") == pytest.approx([3 / 19, 3 / 19])
    assert s["verdict"] == "input-bound", s


def test_fetch_hooks_are_removed_after_fit_and_missing_hooks_fall_back_to_the_gap():
    clock = Ticker()
    timer = StepTimer(log_every_n_steps=1, clock=clock)
    trainer = tiny_trainer([timer], max_steps=2)
    trainer.fit(Linear4(), train_dataloaders=DataLoader(ClockDataset(clock, 0.0), batch_size=2))
    loop = trainer.fit_loop.epoch_loop
    assert "_on_before_fetch" not in vars(loop)
    assert "_on_after_fetch" not in vars(loop)
    assert "batch_to_device" not in vars(trainer.strategy)
    # A Lightning without the loop's fetch hooks: the fetch is not timed and the summary says so.
    bare = StepTimer()
    bare._patch_fetch(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace())))
    assert bare.summary()["step_time"]["fetch_timed"] is False


class BigIdleParameter(pl.LightningModule):
    """A tiny linear layer plus a 40 MB frozen parameter that every checkpoint writes."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)
        self.big = torch.nn.Parameter(torch.zeros(10_000_000), requires_grad=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def test_checkpointing_between_steps_is_not_input_bound(tmp_path):
    # In-memory data, a 40 MB checkpoint every 5 steps. Without timing the fetch the save lands in data_wait
    # (0.68-0.70 measured) and the verdict says "raise data.num_workers".
    data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 2, (4096,)))
    timer = StepTimer()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    trainer = tiny_trainer([timer, ckpt], max_steps=40, log_every_n_steps=20, enable_checkpointing=True)
    trainer.fit(BigIdleParameter(), DataLoader(data, batch_size=32))
    s = timer.summary()["step_time"]
    assert len(list(tmp_path.glob("*.ckpt"))) == 8
    assert s["verdict"] != "input-bound", s
    assert s["data_wait_frac"] < 0.15, s
    assert s["other_frac"] > s["data_wait_frac"], s


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


def _linear_fit(timer: StepTimer, clock: Ticker, max_steps: int, **fit_kwargs: Any) -> pl.Trainer:
    trainer = tiny_trainer([timer], max_steps=max_steps)
    trainer.fit(Linear4(), train_dataloaders=DataLoader(ClockDataset(clock, 0.0), batch_size=2), **fit_kwargs)
    return trainer


def test_a_second_fit_with_the_same_callback_starts_afresh():
    # A second 4-step fit with the same StepTimer must not report 6 steps (3 + 3). Each step here is 9 marks
    # one tick apart (see test_time_between_steps_is_other_and_only_the_fetch_is_data_wait): 9 s.
    clock = Ticker()
    timer = StepTimer(log_every_n_steps=1, warmup_steps=1, clock=clock)
    _linear_fit(timer, clock, max_steps=3)
    assert (timer.split.steps, timer.split.wall) == (2, 18.0)
    _linear_fit(timer, clock, max_steps=3)
    assert (timer.split.steps, timer.split.wall) == (2, 18.0)
    assert timer.summary()["step_time"]["steps"] == 2


def test_a_fit_restored_from_a_checkpoint_adds_to_its_split(tmp_path):
    clock = Ticker()
    timer = StepTimer(log_every_n_steps=1, warmup_steps=1, clock=clock)
    trainer = _linear_fit(timer, clock, max_steps=3)
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    # Lightning restores the split after `setup` of this fit; step 4 is the resumed fit's warm-up, step 5 adds.
    _linear_fit(timer, clock, max_steps=5, ckpt_path=tmp_path / "three.ckpt")
    assert (timer.split.steps, timer.split.wall) == (3, 27.0)


def test_a_split_restored_by_validate_does_not_carry_into_the_next_fit():
    clock = Ticker()
    stale = StepTimer()
    stale._total.add("forward", 50.0)
    stale._total.wall, stale._total.steps = 100.0, 10
    timer = StepTimer(log_every_n_steps=1, warmup_steps=1, clock=clock)
    stand_in = SimpleNamespace()
    timer.setup(stand_in, None, "validate")
    timer.load_state_dict(stale.state_dict())  # trainer.validate(ckpt_path=...) restores callback states too
    timer.teardown(stand_in, None, "validate")
    _linear_fit(timer, clock, max_steps=3)
    assert (timer.split.steps, timer.split.wall) == (2, 18.0)


class _Regression(pl.LightningModule):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        net = torch.nn.Linear(4, 1)
        self.net = torch.compile(net, backend="eager") if compiled else net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("precision", "compiled"), [("bf16-mixed", True), ("32-true", False)])
def test_verdict_is_told_the_precision_and_compilation_of_the_run(monkeypatch, precision, compiled):
    told: dict[str, Any] = {}
    real = step_timer_module.step_verdict

    def verdict(split: Any, **kwargs: Any) -> Any:
        told.update(kwargs)
        return real(split, **kwargs)

    monkeypatch.setattr(step_timer_module, "step_verdict", verdict)
    trainer = tiny_trainer([StepTimer(warmup_steps=0)], max_steps=2, precision=precision)
    trainer.fit(_Regression(compiled), train_dataloaders=DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    assert (told["precision"], told["compiled"]) == (precision, compiled)


def test_compiled_detection_sees_each_way_of_compiling():
    assert not is_compiled(_Regression(compiled=False))
    assert is_compiled(_Regression(compiled=True))  # torch.compile(inner), as LitGPT compile_model
    in_place = _Regression(compiled=False)
    in_place.net.compile(backend="eager")  # nn.Module.compile()
    assert is_compiled(in_place)
    whole = _Regression(compiled=False)
    from_compiled(torch.compile(whole, backend="eager"))  # what fit(torch.compile(module)) does
    assert is_compiled(whole)


@pytest.mark.parametrize(("max_steps", "timed"), [(1, 1), (2, 1), (3, 2)])
def test_the_default_warmup_leaves_a_step_to_time(max_steps, timed):
    timer = StepTimer()
    tiny_trainer([timer], max_steps=max_steps).fit(tiny_module(), tiny_data())
    assert timer.summary()["step_time"]["steps"] == timed
