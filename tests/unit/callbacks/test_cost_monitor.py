import pytest

from lightning_trainopt.callbacks import CostMonitor, StepTimer
from lightning_trainopt.core.hardware import hardware_spec
from lightning_trainopt.exceptions import ConfigError
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
