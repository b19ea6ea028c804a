"""The step time charges what the FLOPs model does not see: offload copies, CPU Adam, NVMe swaps, int8 compression.

Every expected figure is the byte count the memory estimate places, times how often it moves per step, over the
bandwidth given: worked out in each test from the estimate's own terms, never copied from the code's output.
"""

from __future__ import annotations

import math

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import ActivationPolicy, PlanInputs, StrategyLayout, estimate_plan
from lightning_trainopt.planner.offload_time import Bandwidths, int8_bytes_moved_per_element

# 3.7M parameters: each rank's fp32 partition on 2 ranks (7.4 MB) is over DeepSpeed's 1 MiB swap threshold.
MODEL = GPTConfig(vocab_size=4096, n_layers=2, d_model=256, n_heads=4, ffn_hidden=704, max_seq_len=256)
PEAK = 1e12
PCIE, MEM, NVME, ADAM = 10e9, 500e9, 2e9, 1e8
RATES = Bandwidths(PCIE, MEM, NVME, ADAM)
OFFLOAD = ActivationPolicy(offload=True, name="offload")
INT8 = ActivationPolicy(compress_bits=8, name="int8")
ZERO2_OFFLOAD = StrategyLayout("zero2_offload", "deepspeed", 2, offload_optimizer="cpu")
ZERO3_OFFLOAD = StrategyLayout("zero3_offload", "deepspeed", 3, offload_optimizer="cpu", offload_params="cpu")
FSDP_OFFLOAD = StrategyLayout("fsdp_offload", "fsdp", offload_optimizer="cpu", offload_params="cpu")


def _plan(rates: Bandwidths = RATES, device_is_host: bool = False, **kw):
    args = {"micro_batch": 2, "seq_len": 64, "accumulate": 3, "devices": 2, **kw}
    return estimate_plan(PlanInputs(MODEL, **args), None, PEAK, 2.0, bandwidths=rates, device_is_host=device_is_host)


def test_activation_offload_moves_the_saved_bytes_out_and_back_and_the_device_waits():
    e = _plan(activations=OFFLOAD)
    saved = e.memory.bytes("activations", "cpu")
    assert saved > 0
    # Out in the forward and back in the backward of each of the 3 micro-batches, on the compute stream.
    charge = 2 * saved * 3 / PCIE
    assert e.speed.overhead.serial == {"activation offload": pytest.approx(charge)}
    assert e.speed.step_time_s == pytest.approx(e.speed.compute_s + charge)
    slower_link = _plan(Bandwidths(PCIE / 4, MEM, NVME, ADAM), activations=OFFLOAD)
    assert slower_link.speed.overhead.serial["activation offload"] == pytest.approx(4 * charge)
    kept = _plan()
    assert kept.speed.overhead.serial == {}
    assert kept.speed.step_time_s == pytest.approx(kept.speed.compute_s)


@pytest.mark.parametrize(("precision", "moved"), [("bf16-mixed", 68), ("32-true", 58)])
def test_int8_compression_is_charged_kernel_by_kernel_at_memory_bandwidth(precision, moved):
    # Quantise: aminmax a, float() a+4 (half only), abs 8, amax 4, / 8, round 8, clamp_ 8, to(int8) 5;
    # dequantise: float() 5, * 8, to(dtype) 4+a (half only). Half: 2+6+41+13+6 = 68; fp32: 4+41+13 = 58.
    a = 2 if precision == "bf16-mixed" else 4
    assert int8_bytes_moved_per_element(a) == moved
    e = _plan(activations=INT8, trainer_precision=precision)
    stored = e.memory.bytes("activations")
    elements = stored * 64 / 68  # int8 codes + one fp32 scale per 64 elements
    charge = elements * moved * 3 / MEM
    assert e.speed.overhead.serial == {"int8 activation compression": pytest.approx(charge)}
    assert e.speed.step_time_s == pytest.approx(e.speed.compute_s + charge)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_zero2_offload_gradients_out_beside_compute_then_cpu_adam_and_the_partition_back(accumulate):
    e = _plan(layout=ZERO2_OFFLOAD, accumulate=accumulate)
    p = math.ceil(MODEL.n_params() / 2)
    o = e.speed.overhead
    # fp32 gradient partition at the boundary; with accumulation the 2 B partition goes out after every micro-batch
    # and comes back before the next.
    d2h = 4 * p + (2 * p * accumulate if accumulate > 1 else 0)
    h2d = 2 * p * (accumulate - 1)
    assert o.overlapped.get("PCIe device -> host") == pytest.approx(d2h / PCIE)
    assert o.overlapped.get("PCIe host -> device", 0.0) == pytest.approx(h2d / PCIE)
    # The node's 2 ranks update their partitions on its shared cores; the 2 B partition returns before the forward.
    assert o.serial == {
        "CPU Adam": pytest.approx(p * 2 / ADAM),
        "updated parameters to the device": pytest.approx(2 * p / PCIE),
    }
    assert e.speed.step_time_s == pytest.approx(
        max(e.speed.compute_s, d2h / PCIE, h2d / PCIE) + p * 2 / ADAM + 2 * p / PCIE
    )


def test_zero3_parameter_offload_fetches_each_forward_and_backward_beside_compute():
    e = _plan(layout=ZERO3_OFFLOAD)
    p = math.ceil(MODEL.n_params() / 2)
    params = e.memory.bytes("params", "cpu")
    assert params > 0
    o = e.speed.overhead
    assert o.overlapped["PCIe host -> device"] == pytest.approx((2 * p * 2 + 2 * 3 * params) / PCIE)
    assert o.overlapped["PCIe device -> host"] == pytest.approx((4 * p + 2 * p * 3) / PCIE)
    assert o.serial == {"CPU Adam": pytest.approx(p * 2 / ADAM)}  # parameters are updated where they live


def test_fsdp_offload_moves_shards_every_micro_batch_and_steps_on_the_cpu():
    e = _plan(layout=FSDP_OFFLOAD)
    params, grads = e.memory.bytes("params", "cpu"), e.memory.bytes("grads", "cpu")
    assert params > 0
    assert grads > 0
    o = e.speed.overhead
    assert o.overlapped == {
        "PCIe host -> device": pytest.approx(2 * 3 * params / PCIE),
        "PCIe device -> host": pytest.approx(3 * grads / PCIE),
    }
    assert o.serial == {"CPU AdamW (fused)": pytest.approx(math.ceil(MODEL.n_params() / 2) * 2 / ADAM)}


@pytest.mark.parametrize("max_in_cpu", [1_000_000_000, 0])
def test_zero_infinity_swaps_states_once_and_nvme_parameters_per_pass(max_in_cpu):
    layout = StrategyLayout(
        "zero_infinity", "deepspeed", 3, offload_optimizer="nvme", offload_params="nvme", max_in_cpu=max_in_cpu
    )
    e = _plan(layout=layout)
    states = e.memory.bytes("grads", "nvme") + e.memory.bytes("optimizer_states", "nvme")
    params = e.memory.bytes("params", "nvme")
    assert states > 0
    assert (params > 0) is (max_in_cpu == 0)
    # States written and read once; parameters on NVMe read for 3 forwards and 3 backwards, written once; the
    # node's 2 ranks share its drives.
    assert e.speed.overhead.serial["NVMe swaps"] == pytest.approx((2 * states + 7 * params) * 2 / NVME)


def test_a_missing_rate_leaves_its_item_uncharged_and_names_the_key():
    e = _plan(Bandwidths(), layout=ZERO2_OFFLOAD, activations=OFFLOAD)
    o = e.speed.overhead
    assert (o.serial, o.overlapped) == ({}, {})
    text = " ".join(o.not_charged)
    assert "hardware.pcie_gb_per_s" in text
    assert "hardware.cpu_adam_params_per_s" in text
    assert e.speed.step_time_s == pytest.approx(e.speed.compute_s)


def test_on_a_cpu_device_nothing_crosses_pcie_and_the_optimizer_runs_there_anyway():
    e = _plan(device_is_host=True, layout=ZERO2_OFFLOAD, activations=OFFLOAD)
    assert e.speed.overhead.serial == {}
    assert e.speed.overhead.overlapped == {}
    compressed = _plan(device_is_host=True, activations=INT8)
    assert set(compressed.speed.overhead.serial) == {"int8 activation compression"}


@pytest.mark.parametrize(
    ("rates", "key"),
    [
        ({"pcie_bytes_per_s": 0.0}, "hardware.pcie_gb_per_s"),
        ({"memory_bytes_per_s": -1.0}, "hardware.memory_gb_per_s"),
        ({"nvme_bytes_per_s": math.inf}, "hardware.nvme_gb_per_s"),
        ({"cpu_adam_params_per_s": 0.0}, "hardware.cpu_adam_params_per_s"),
    ],
)
def test_bad_rates_are_refused_naming_the_key(rates, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Bandwidths(**rates)
