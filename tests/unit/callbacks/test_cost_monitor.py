import pytest

from lightning_trainopt.callbacks import CostMonitor, StepTimer
from lightning_trainopt.core.hardware import hardware_spec
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.tiny_fit import ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock


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
