"""The window accumulator the measuring callbacks share (``metrics.throughput.TrainingWindow``), with a mocked clock."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.metrics.throughput import TrainingWindow, WindowCounts, throughput


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_counts_and_seconds_of_one_window(clock):
    w = TrainingWindow(clock)
    w.add(4, 64, 1000, 1300)  # before the clock starts: counted, no time yet
    assert w.seconds() == 0.0
    w.start()
    clock.t += 2.0
    w.add(4, 32, 1000)  # hardware FLOPs default to the model FLOPs
    clock.t += 1.0
    assert w.counts() == WindowCounts(3.0, 2, 8, 96, 2000, 2300)
    assert w.batches == 2


def test_close_starts_the_next_window_at_once(clock):
    w = TrainingWindow(clock)
    w.start()
    w.add(2, 10)
    clock.t += 5.0
    first = w.close()
    assert (first.seconds, first.batches, first.tokens) == (5.0, 1, 10)
    clock.t += 1.5  # time after the close belongs to the next window, with no gap
    w.add(2, 10)
    assert (w.counts().seconds, w.batches) == (1.5, 1)


def test_a_pause_leaves_its_span_out(clock):
    w = TrainingWindow(clock)
    w.pause()  # nothing runs yet: no effect (a sanity check before training)
    w.resume()
    w.start()
    clock.t += 2.0
    w.pause()
    w.pause()  # a second pause keeps the first one's time
    clock.t += 10.0
    assert w.seconds() == 2.0
    w.resume()
    clock.t += 3.0
    assert w.seconds() == 5.0
    assert w.started
    assert not w.paused


def test_start_does_not_restart_a_running_clock(clock):
    w = TrainingWindow(clock)
    w.start()
    clock.t += 4.0
    w.start()
    clock.t += 1.0
    assert w.seconds() == 5.0


def test_reset_drops_counts_and_stops_the_clock(clock):
    w = TrainingWindow(clock)
    w.start()
    w.add(1, 1)
    clock.t += 3.0
    w.reset()
    assert not w.started
    assert w.counts() == WindowCounts()
    clock.t += 3.0
    assert w.seconds() == 0.0


def test_unknown_counts_stay_unknown(clock):
    w = TrainingWindow(clock)
    w.start()
    w.add(4, 64, 100)
    w.add(None, None, None)  # a batch that could not be sized, FLOPs that could not be counted
    w.add(4, torch.tensor(5), 100)
    clock.t += 1.0
    c = w.counts()
    assert (c.batches, c.samples, c.tokens, c.model_flops, c.hardware_flops) == (3, None, None, None, None)
    rates = c.rates(world_size=2, peak_flops=1e3)
    assert (rates.tokens_per_s, rates.samples_per_s, rates.mfu, rates.tflops_per_s) == (None, None, None, None)


def test_device_token_counts_are_read_only_when_asked(clock, monkeypatch):
    reads = []
    item = torch.Tensor.item

    def counted_item(self):
        reads.append(self)
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counted_item)
    w = TrainingWindow(clock)
    w.start()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for _ in range(5):
        w.add(2, mask.sum())
    w.add(2, 7)  # host counts mix in
    assert reads == []  # adding never reads a tensor back
    clock.t += 1.0
    assert w.counts().tokens == 5 * 3 + 7
    assert len(reads) == 1
    assert w.counts().tokens == 22  # folded into the host count: no second read
    assert len(reads) == 1


def test_restore_carries_a_saved_window(clock):
    w = TrainingWindow(clock)
    w.restore(WindowCounts(seconds=2.5, batches=3, samples=12, tokens=120, model_flops=30, hardware_flops=40))
    assert w.seconds() == 2.5
    assert not w.started
    w.start()
    clock.t += 1.0
    w.add(4, 40, 10, 20)
    assert w.close() == WindowCounts(3.5, 4, 16, 160, 40, 60)


def test_counts_add_and_give_the_rates_of_throughput():
    a = WindowCounts(2.0, 1, 4, 64, 600, 800)
    b = WindowCounts(6.0, 3, 12, 192, 1800, 2400)
    assert a + b == WindowCounts(8.0, 4, 16, 256, 2400, 3200)
    assert a + WindowCounts(1.0, 1, None, 1, None, None) == WindowCounts(3.0, 2, None, 65, None, None)
    total = a + b
    assert total.rates(world_size=4, peak_flops=1e3) == throughput(8.0, 16, 256, 4, 2400, 3200, 1e3)


@pytest.mark.parametrize(
    "counts",
    [WindowCounts(1.5, 2, 8, 100, 10, 12), WindowCounts(1.5, 2, None, None, None, None), WindowCounts()],
)
def test_counts_round_trip_as_plain_data(counts):
    state = counts.to_dict()
    assert all(v is None or type(v) in (int, float, bool) for v in state.values())
    assert state["flops_known"] is (counts.model_flops is not None)
    assert WindowCounts.from_dict(state) == counts


def test_counts_read_a_state_without_batches_or_with_flops_marked_unknown():
    # SpeedMonitor's totals before the accumulator moved to core: no batch count, FLOP sums with a flag beside them.
    old = {"seconds": 4.0, "samples": 8, "tokens": 64, "model_flops": 50, "hardware_flops": 60, "flops_known": False}
    assert WindowCounts.from_dict(old) == WindowCounts(4.0, 0, 8, 64, None, None)
