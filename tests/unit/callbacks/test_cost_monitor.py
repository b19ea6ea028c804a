from types import SimpleNamespace

import pytest
import torch

from lightning_trainopt.callbacks import CostMonitor, StepTimer
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.hardware import hardware_spec
from tests.helpers.tiny_fit import ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock
from tests.unit.callbacks._foreign import ObjectBatchClassifier, loader, object_batches


def test_exact_dollars_with_mocked_clock():
    clock = StepClock(dt=2.0)
    # $3600 per device-hour = $1 per device-second.
    monitor = CostMonitor(hardware=hardware_spec("cpu", price_per_device_hour=3600.0), log_every_n_steps=1, clock=clock)
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=4, logger=logger)
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    assert logger.values("cost/dollars") == [2.0, 4.0, 6.0, 8.0]
    assert logger.values("cost/projected_total_dollars") == [8.0, 8.0, 8.0, 8.0]
    assert logger.values("cost/projected_hours_left") == pytest.approx([6 / 3600, 4 / 3600, 2 / 3600, 0.0])
    s = monitor.summary()["cost"]
    assert s["dollars"] == 8.0
    assert s["dollars_per_1b_tokens"] == pytest.approx(8.0 / 256 * 1e9)
    assert s["dollars_per_1m_samples"] == pytest.approx(8.0 / 16 * 1e6)
    assert (s["tokens"], s["samples"]) == (256, 16)
    assert len(logger.values("cost/dollars_per_1m_samples")) == 4
    assert s["price_source"] == "user-set"
    assert s["idle_fraction"] is None  # neither StepTimer nor GPUMonitor present


def test_resume_adds_to_the_restored_figures_and_idle_from_step_timer():
    clock = StepClock(dt=1.0)
    first = CostMonitor(price_per_device_hour=3600.0, clock=clock)
    tiny_trainer([clock, first], max_steps=2).fit(tiny_module(), tiny_data())
    second = CostMonitor(price_per_device_hour=3600.0, clock=clock)
    second.load_state_dict(first.state_dict())
    timer = StepTimer(warmup_steps=0)
    tiny_trainer([clock, second, timer], max_steps=3).fit(tiny_module(), tiny_data())
    s = second.summary()["cost"]
    assert s["dollars"] == 2.0 + 3.0
    assert s["idle_fraction"] is not None
    assert 0.0 <= s["idle_fraction"] < 1.0


def test_no_price_reports_hours_only():
    clock = StepClock(dt=1.0)
    monitor = CostMonitor(hardware="cpu", clock=clock)
    with pytest.warns(UserWarning, match="price_per_device_hour"):
        tiny_trainer([clock, monitor], max_steps=2).fit(tiny_module(), tiny_data())
    s = monitor.summary()["cost"]
    assert s["dollars"] is None
    assert s["device_hours"] == pytest.approx(2 / 3600)
    with pytest.raises(ConfigError, match="price_per_device_hour"):
        CostMonitor(price_per_device_hour=-1)


def test_a_run_shorter_than_the_logging_window_logs_its_cost_once():
    clock = StepClock(dt=2.0)
    monitor = CostMonitor(price_per_device_hour=3600.0, clock=clock)
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=3, logger=logger, log_every_n_steps=50).fit(tiny_module(), tiny_data())
    assert logger.values("cost/dollars") == [6.0]
    assert logger.rows[-1][0] == 3


def test_a_batch_it_cannot_size_still_gets_dollars_and_hours():
    clock = StepClock(dt=1.0)
    monitor = CostMonitor(price_per_device_hour=3600.0, target_tokens=1000, clock=clock)
    with pytest.warns(UserWarning, match="cannot size a batch of type Batch") as record:
        tiny_trainer([clock, monitor], max_steps=3).fit(ObjectBatchClassifier(), loader(object_batches(3)))
    sizing = [str(w.message) for w in record if "cannot size" in str(w.message)]
    assert len(sizing) == 1
    assert "per-token and per-sample figures are left out" in sizing[0]
    assert "Pass samples_fn=batch -> int and tokens_fn=batch -> int to CostMonitor" in sizing[0]
    s = monitor.summary()["cost"]
    assert (s["dollars"], s["device_hours"]) == (3.0, pytest.approx(3 / 3600))
    assert (s["tokens"], s["dollars_per_1b_tokens"], s["projected_total_dollars"]) == (None, None, None)


def test_tokens_fn_and_samples_fn_size_any_batch():
    clock = StepClock(dt=1.0)
    monitor = CostMonitor(
        price_per_device_hour=3600.0,
        tokens_fn=lambda b: b.ids.numel(),
        samples_fn=lambda b: b.ids.shape[0],
        target_tokens=1e9,  # Hydra reads 1e9 as a float
        clock=clock,
    )
    assert monitor.target_tokens == 10**9
    tiny_trainer([clock, monitor], max_steps=3).fit(ObjectBatchClassifier(), loader(object_batches(3)))
    s = monitor.summary()["cost"]
    assert (s["tokens"], s["samples"]) == (72, 12)
    assert s["dollars_per_1b_tokens"] == pytest.approx(3.0 / 72 * 1e9)
    assert s["projected_seconds_left"] == pytest.approx(3.0 * (10**9 - 72) / 72)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"price_per_device_hour": "abc"}, "price_per_device_hour='abc' is invalid: use a number >= 0 (a number, not"),
        ({"price_per_device_hour": -1}, "callbacks.cost_monitor.price_per_device_hour=-1 is invalid"),
        ({"target_tokens": 1.5}, "target_tokens=1.5 is invalid: use a whole number >= 1, e.g. 1e9"),
        ({"target_tokens": "1e9"}, "target_tokens='1e9' is invalid"),
        ({"target_tokens": 0}, "target_tokens=0 is invalid"),
        ({"target_tokens": True}, "target_tokens=True is invalid"),
        ({"hardware": "h1000"}, "callbacks.cost_monitor.hardware='h1000' is invalid: use auto or one of"),
        ({"tokens_fn": 5}, "callbacks.cost_monitor.tokens_fn=5 is invalid"),
        ({"log_every_n_steps": 0}, "callbacks.cost_monitor.log_every_n_steps=0 is invalid"),
    ],
)
def test_bad_arguments_are_refused_in_init(kwargs, message):
    with pytest.raises(ConfigError) as info:
        CostMonitor(**kwargs)
    assert message in str(info.value)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _stand_in(world_size: int, global_step: int, max_steps: int = 100) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=world_size,
        global_step=global_step,
        max_steps=max_steps,
        estimated_stepping_batches=max_steps,
        callbacks=[],
        is_global_zero=True,
        loggers=[],
        callback_metrics={},
        log_every_n_steps=1,
    )


def _train(monitor: CostMonitor, trainer: SimpleNamespace, clock: Clock, steps: int, seconds: float) -> None:
    """``steps`` optimizer steps of one (2, 50)-token batch per rank, ``seconds`` in all."""
    for _ in range(steps):
        monitor.on_train_batch_start(trainer, None, torch.zeros(2, 50, dtype=torch.long), 0)
        clock.t += seconds / steps
        trainer.global_step += 1
        monitor.on_train_batch_end(trainer, None, None, None, 0)


def _hour_on_two_devices(clock: Clock) -> dict:
    """The state of 1 h on 2 devices at $10/device-hour: 10 steps of 100 tokens (2 samples) per rank."""
    first = CostMonitor(price_per_device_hour=10.0, clock=clock)
    first.setup(SimpleNamespace(), None, "fit")
    two = _stand_in(world_size=2, global_step=0)
    first.on_train_start(two, None)
    _train(first, two, clock, steps=10, seconds=3600.0)
    assert first.report(two).dollars == 20.0
    assert first.summary()["cost"]["tokens"] == 2000
    return first.state_dict()


def test_a_resume_on_another_world_size_bills_earlier_time_at_its_own_world_size():
    # 1 h on 2 devices at $10/device-hour is $20 and 2 x 1000 tokens; resumed on 4 devices it must not report
    # $40 and 4000 tokens before training a step (the restored seconds and per-rank tokens x the new world size).
    clock = Clock()
    monitor = CostMonitor(price_per_device_hour=10.0, clock=clock)
    monitor.setup(SimpleNamespace(), None, "fit")
    monitor.load_state_dict(_hour_on_two_devices(clock))
    four = _stand_in(world_size=4, global_step=10, max_steps=30)
    monitor.on_train_start(four, None)
    r = monitor.report(four)
    assert (r.device_hours, r.dollars, r.projected_total_dollars) == (2.0, 20.0, None)
    assert monitor.summary()["cost"]["tokens"] == 2000
    # 10 steps in 30 min on 4 devices: 2 device-hours more; 10 steps left at this run's rate are 30 min on 4 devices.
    _train(monitor, four, clock, steps=10, seconds=1800.0)
    r = monitor.report(four)
    assert (r.device_hours, r.dollars) == (4.0, 40.0)
    assert r.projected_seconds_left == pytest.approx(1800.0)
    assert r.projected_total_dollars == pytest.approx(40.0 + 2.0 * 10.0)
    assert monitor.state_dict() == {"device_hours": 4.0, "tokens": 2000 + 4 * 1000, "samples": 40 + 4 * 20}


def test_a_token_target_projects_at_the_resumed_runs_rate():
    clock = Clock()
    monitor = CostMonitor(price_per_device_hour=10.0, target_tokens=10_000, clock=clock)
    monitor.setup(SimpleNamespace(), None, "fit")
    monitor.load_state_dict(_hour_on_two_devices(clock))
    four = _stand_in(world_size=4, global_step=10)
    monitor.on_train_start(four, None)
    _train(monitor, four, clock, steps=4, seconds=360.0)  # 4 x 100 tokens x 4 ranks = 1600 tokens in 360 s
    r = monitor.report(four)
    assert r.projected_seconds_left == pytest.approx(360.0 * (10_000 - 3600) / 1600)
    assert r.projected_total_dollars == pytest.approx(r.dollars + r.projected_seconds_left / 3600 * 4 * 10.0)


def test_a_state_without_device_hours_is_refused():
    # Pre-release checkpoints stored wall seconds and one rank's counts; they are not converted.
    monitor = CostMonitor(price_per_device_hour=10.0)
    with pytest.raises(KeyError, match="device_hours"):
        monitor.load_state_dict({"elapsed_s": 3600.0, "tokens": 1000, "samples": 10})


def test_a_second_fit_with_the_same_callback_starts_afresh():
    # Two 4-step fits with the same callback: the second must not report both fits' 512 tokens and $8.
    clock = StepClock(dt=1.0)
    monitor = CostMonitor(price_per_device_hour=3600.0, clock=clock)
    tiny_trainer([clock, monitor], max_steps=2).fit(tiny_module(), tiny_data())
    assert monitor.summary()["cost"]["dollars"] == 2.0
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(tiny_module(), tiny_data())
    s = monitor.summary()["cost"]
    assert (s["dollars"], s["device_hours"], s["tokens"], s["samples"]) == (2.0, 2 / 3600, 128, 8)
    assert logger.values("cost/dollars") == [1.0, 2.0]
    assert logger.values("cost/projected_total_dollars") == [2.0, 2.0]


def test_a_fit_restored_from_a_checkpoint_adds_to_its_figures(tmp_path):
    clock = StepClock(dt=1.0)
    monitor = CostMonitor(price_per_device_hour=3600.0, clock=clock)
    first = tiny_trainer([clock, monitor], max_steps=2)
    first.fit(tiny_module(), tiny_data())
    first.save_checkpoint(tmp_path / "two.ckpt")
    # Lightning restores the checkpoint's figures after `setup` of this fit: 2 + 1 steps, one rate for the projection.
    logger = ListLogger()
    resumed = tiny_trainer([clock, monitor], max_steps=3, logger=logger)
    resumed.fit(tiny_module(), tiny_data(), ckpt_path=tmp_path / "two.ckpt")
    s = monitor.summary()["cost"]
    assert (s["dollars"], s["tokens"], s["samples"], s["projected_total_dollars"]) == (3.0, 192, 12, 3.0)
    assert logger.values("cost/dollars") == [3.0]


def test_a_state_restored_by_validate_does_not_carry_into_the_next_fit():
    clock = Clock()
    monitor = CostMonitor(price_per_device_hour=10.0, clock=clock)
    state = _hour_on_two_devices(clock)
    monitor.setup(SimpleNamespace(), None, "validate")
    monitor.load_state_dict(state)  # trainer.validate(ckpt_path=...) restores callback states too
    monitor.teardown(SimpleNamespace(), None, "validate")
    monitor.setup(SimpleNamespace(), None, "fit")
    one = _stand_in(world_size=1, global_step=0)
    monitor.on_train_start(one, None)
    _train(monitor, one, clock, steps=1, seconds=360.0)
    assert monitor.report(one).dollars == pytest.approx(1.0)
    assert monitor.summary()["cost"]["tokens"] == 100
