"""estimate_plan's verdict: the device peak against the device, and the node's offloaded bytes against its RAM."""

from __future__ import annotations

from lightning_trainopt.models import GPTConfig
from lightning_trainopt.planner import PlanInputs, StrategyLayout, estimate_plan

GIB = 2**30
MODEL = GPTConfig(name="t", vocab_size=1000, n_layers=2, d_model=64, n_heads=4, ffn_hidden=256, max_seq_len=64)
OFFLOAD = StrategyLayout("zero2_offload", "deepspeed", 2, offload_optimizer="cpu")


def _plan(layout: StrategyLayout, host: int | None, devices: int = 4, headroom: float = 0.1):
    inputs = PlanInputs(MODEL, layout=layout, micro_batch=2, seq_len=64, devices=devices, num_nodes=2)
    return estimate_plan(inputs, 80 * GIB, 1e15, 1.0, headroom_fraction=headroom, host_memory_bytes=host)


def test_the_nodes_offloaded_bytes_are_each_ranks_times_its_devices():
    e = _plan(OFFLOAD, host=GIB)
    per_rank = e.memory.bytes(location="cpu")
    assert per_rank > 0
    assert e.host_bytes_per_node == 4 * per_rank  # devices per node, not the world size of 8
    assert e.host_usable_bytes == GIB - int(0.1 * GIB)
    assert e.host_fits is True
    assert e.fits is True


def test_a_node_without_the_ram_does_not_fit_even_when_the_device_does():
    need = _plan(OFFLOAD, host=GIB).host_bytes_per_node
    assert _plan(OFFLOAD, host=need, headroom=0.0).host_fits is True
    tight = _plan(OFFLOAD, host=need - 1, headroom=0.0)
    assert tight.device_fits is True
    assert tight.host_fits is False
    assert tight.fits is False
    # The headroom share is kept free on the host too.
    assert _plan(OFFLOAD, host=need, headroom=0.1).host_fits is False


def test_unknown_ram_gives_no_host_verdict_and_leaves_the_device_verdict():
    e = _plan(OFFLOAD, host=None)
    assert e.host_fits is None
    assert e.fits is e.device_fits is True


def test_nothing_offloaded_needs_no_ram():
    e = _plan(StrategyLayout("zero2", "deepspeed", 2), host=1)
    assert e.host_bytes_per_node == 0
    assert e.host_fits is True
