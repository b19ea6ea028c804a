import re

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.hardware import (
    HARDWARE,
    HardwareSpec,
    compute_dtype_key,
    detect_hardware,
    hardware_spec,
    preset_for_device_name,
)


def test_every_preset_has_sources_and_dense_peaks():
    for key, spec in HARDWARE.items():
        assert {"peak", "price", "memory", "host_memory", "pcie", "memory_bandwidth", "nvme", "cpu_adam"} <= set(
            spec.sources
        ), key
        if spec.peak_flops:
            # Dense bf16 is never above twice fp16's figure nor below fp32's on these chips.
            assert spec.peak("bf16") >= spec.peak("fp32"), key


def test_default_prices_per_device_hour():
    assert hardware_spec("a100_40gb").price_per_device_hour == 3.5
    assert hardware_spec("a100_80gb").price_per_device_hour == 4.8
    assert hardware_spec("h100").price_per_device_hour == 8.2
    assert hardware_spec("h200").price_per_device_hour is None
    assert "price_per_device_hour" in hardware_spec("h200").sources["price"]


def test_dense_h100_bf16_is_half_the_sparse_datasheet_figure():
    assert hardware_spec("h100_sxm").peak("bf16") == pytest.approx(1978.9e12 / 2, rel=1e-3)


def test_overrides_and_sources():
    spec = hardware_spec("a100_80gb", price_per_device_hour=2.0, peak_tflops={"bf16": 250}, memory_gb=80)
    assert spec.price_per_device_hour == 2.0
    assert spec.peak("bf16") == 250e12
    assert spec.peak("fp16") == 312e12
    assert spec.sources["price"] == "user-set"
    assert spec.memory_bytes == 80 * 2**30


def test_host_memory_is_the_reference_nodes_and_overridable():
    # AWS p4d/p4de: 8 x A100 with 1152 GiB; p5/p5e: 8 x H100/H200 with 2048 GiB; g5.48xlarge: 8 x A10G, 768 GiB.
    assert hardware_spec("a100_40gb").host_memory_bytes == 1152 * 2**30
    assert hardware_spec("a100_80gb").host_memory_bytes == 1152 * 2**30
    assert hardware_spec("h100").host_memory_bytes == 2048 * 2**30
    assert hardware_spec("h200").host_memory_bytes == 2048 * 2**30
    assert hardware_spec("a10g").host_memory_bytes == 768 * 2**30
    assert "p5.48xlarge" in hardware_spec("h100").sources["host_memory"]
    # No standard node for a PCIe card, nor for "cpu": unknown, and the source says how to set it.
    assert hardware_spec("h100_pcie").host_memory_bytes is None
    assert "hardware.host_memory_gb" in hardware_spec("cpu").sources["host_memory"]
    spec = hardware_spec("h100", host_memory_gb=512)
    assert spec.host_memory_bytes == 512 * 2**30
    assert spec.sources["host_memory"] == "user-set"
    assert spec.to_dict()["host_memory_bytes"] == 512 * 2**30


def test_auto_takes_this_machines_ram():
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert hardware_spec("auto").host_memory_bytes == ram


def test_bandwidths_are_the_datasheets_each_way_and_overridable():
    # Datasheets quote PCIe both directions together (Gen4 x16 64 GB/s, Gen5 x16 128 GB/s): half of it each way.
    assert hardware_spec("a100_40gb").pcie_bytes_per_s == 32e9
    assert hardware_spec("h100").pcie_bytes_per_s == 64e9
    assert hardware_spec("l4").pcie_bytes_per_s == 32e9
    assert "PCIe Gen4 x16 64 GB/s both directions" in hardware_spec("a100_80gb").sources["pcie"]
    # Device memory bandwidth, datasheet figures.
    assert hardware_spec("a100_40gb").memory_bytes_per_s == 1555e9
    assert hardware_spec("a100_80gb").memory_bytes_per_s == 2039e9
    assert hardware_spec("h100").memory_bytes_per_s == 3350e9
    assert hardware_spec("h200").memory_bytes_per_s == 4800e9
    # The node figures are project defaults and say so; the CPU has none (nothing crosses PCIe there).
    assert "not a measurement of your node" in hardware_spec("a100_80gb").sources["nvme"]
    assert "hardware.cpu_adam_params_per_s" in hardware_spec("a100_80gb").sources["cpu_adam"]
    cpu = hardware_spec("cpu")
    assert (cpu.pcie_bytes_per_s, cpu.memory_bytes_per_s, cpu.nvme_bytes_per_s, cpu.cpu_adam_params_per_s) == (
        None,
        None,
        None,
        None,
    )
    assert "hardware.pcie_gb_per_s" in cpu.sources["pcie"]
    spec = hardware_spec(
        "a100_80gb", pcie_gb_per_s=25, memory_gb_per_s=1800, nvme_gb_per_s=3, cpu_adam_params_per_s=4e9
    )
    assert (spec.pcie_bytes_per_s, spec.memory_bytes_per_s, spec.nvme_bytes_per_s, spec.cpu_adam_params_per_s) == (
        25e9,
        1800e9,
        3e9,
        4e9,
    )
    assert all(spec.sources[k] == "user-set" for k in ("pcie", "memory_bandwidth", "nvme", "cpu_adam"))
    assert spec.to_dict()["pcie_gb_per_s"] == 25
    assert spec.sources["peak"] == hardware_spec("a100_80gb").sources["peak"]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "l4", "pcie_gb_per_s": 0}, "hardware.pcie_gb_per_s"),
        ({"name": "l4", "pcie_gb_per_s": "fast"}, "hardware.pcie_gb_per_s"),
        ({"name": "l4", "memory_gb_per_s": -300}, "hardware.memory_gb_per_s"),
        ({"name": "l4", "nvme_gb_per_s": float("inf")}, "hardware.nvme_gb_per_s"),
        ({"name": "l4", "cpu_adam_params_per_s": True}, "hardware.cpu_adam_params_per_s"),
        ({"name": "l4", "cpu_adam_params_per_s": 0}, "hardware.cpu_adam_params_per_s"),
    ],
)
def test_bad_bandwidths_are_refused_naming_the_key_and_the_unit(kwargs, key):
    with pytest.raises(ConfigError) as err:
        hardware_spec(**kwargs)
    assert err.value.key == key
    assert ("parameters per second" if "params" in key else "GB/s") in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "tpu9"}, "hardware.name"),
        ({"name": "l4", "host_memory_gb": 0}, "hardware.host_memory_gb"),
        ({"name": "l4", "host_memory_gb": "1TB"}, "hardware.host_memory_gb"),
        ({"name": "l4", "price_per_device_hour": -1.0}, "hardware.price_per_device_hour"),
        ({"name": "l4", "peak_tflops": {"bf16": 0}}, "hardware.peak_tflops.bf16"),
        ({"name": "l4", "peak_tflops": {"bf17": 10}}, "hardware.peak_tflops.bf17"),
    ],
)
def test_bad_input_names_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        hardware_spec(**kwargs)


@pytest.mark.parametrize(
    ("name", "memory", "key"),
    [
        ("NVIDIA H100 80GB HBM3", None, "h100_sxm"),
        ("NVIDIA H100 PCIe", None, "h100_pcie"),
        ("NVIDIA H200", None, "h200"),
        ("NVIDIA A100-SXM4-80GB", None, "a100_80gb"),
        ("NVIDIA A100-SXM4-40GB", None, "a100_40gb"),
        ("NVIDIA A100-PCIE", 80 * 2**30, "a100_80gb"),
        ("NVIDIA L40S", None, "l40s"),
        ("NVIDIA L4", None, "l4"),
        ("NVIDIA A10G", None, "a10g"),
        ("NVIDIA H800", None, "h100_sxm"),
        ("NVIDIA H800 PCIe", None, "h100_pcie"),
        ("NVIDIA A800-SXM4-80GB", None, "a100_80gb"),
        ("NVIDIA H100 NVL", None, None),  # lower power limit than SXM: no preset rather than a wrong peak
        ("NVIDIA H200 NVL", None, None),
        ("Tesla T4", None, None),
    ],
)
def test_device_name_detection(name, memory, key):
    assert preset_for_device_name(name, memory) == key


def test_detect_on_this_machine_is_consistent():
    import torch

    spec = detect_hardware()
    if not torch.cuda.is_available():
        assert spec.name == "cpu"
        assert spec.peak("bf16") is None
    else:
        assert spec.memory_bytes == torch.cuda.get_device_properties(0).total_memory


def test_compute_dtype_key():
    assert compute_dtype_key("bf16-mixed", True) == "bf16"
    assert compute_dtype_key("16-mixed", True) == "fp16"
    assert compute_dtype_key("32-true", True, "high") == "tf32"
    assert compute_dtype_key("32-true", True, "highest") == "fp32"
    assert compute_dtype_key("32-true", False, "high") == "fp32"
    assert compute_dtype_key("transformer-engine", True) == "fp8"


def test_spec_validates_itself():
    with pytest.raises(ConfigError, match="hardware.price_per_device_hour"):
        HardwareSpec("x", price_per_device_hour=-2.0)
    with pytest.raises(ConfigError, match="hardware.pcie_gb_per_s"):
        HardwareSpec("x", pcie_bytes_per_s=0.0)
    with pytest.raises(ConfigError, match="hardware.cpu_adam_params_per_s"):
        HardwareSpec("x", cpu_adam_params_per_s=-1.0)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"price_per_device_hour": "abc"}, "hardware.price_per_device_hour"),
        ({"price_per_device_hour": True}, "hardware.price_per_device_hour"),
        ({"memory_gb": "80"}, "hardware.memory_gb"),
    ],
)
def test_override_of_the_wrong_type_is_a_config_error(kwargs, key):
    # Called directly (the Python API, or a Hydra _target_), not only through train.py's validation.
    with pytest.raises(ConfigError) as err:
        hardware_spec("h100", **kwargs)
    assert err.value.key == key


def test_sources_say_where_a_figure_comes_from_not_which_ticket():
    # Printed on plan.py's screen: a plain statement of the source, no issue numbers or audit notes.
    ticket = re.compile(r"\bissues?\s*#?\d|\baudit\b|#\d", re.IGNORECASE)
    for key, spec in HARDWARE.items():
        for what, source in spec.sources.items():
            assert source.strip(), (key, what)
            assert not ticket.search(source), (key, what, source)
    assert "hardware.price_per_device_hour" in hardware_spec("a100_80gb").sources["price"]
