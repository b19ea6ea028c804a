"""Device facts as data: dense peak FLOP/s per dtype, memory, price per device-hour, each with a source.

Figures are *dense* tensor-core peaks (NVIDIA datasheets quote "with sparsity" figures at twice these).
Every entry can be overridden: ``hardware_spec("h100_sxm", price_per_device_hour=2.5, peak_tflops={"bf16": 800})``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_trainopt.exceptions import ConfigError

__all__ = [
    "DTYPE_KEYS",
    "HARDWARE",
    "HardwareSpec",
    "compute_dtype_key",
    "detect_hardware",
    "hardware_spec",
    "preset_for_device_name",
]

#: dtype keys of the peak tables (``tf32`` is what fp32 matmuls run as when TF32 is allowed).
DTYPE_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")

_GIB = 1024**3
_GB = 1000**3

_SRC_A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4), dense tensor-core figures"
_SRC_H100 = "NVIDIA H100 datasheet (h100-datasheet-2430615), dense = half of the 'with sparsity' figures"
_SRC_H200 = "NVIDIA H200 datasheet (hpc-datasheet-sc23-h200), dense = half of the 'with sparsity' figures"
_SRC_L40S = "NVIDIA L40S datasheet (l40s-datasheet-2849214), dense = half of the 'with sparsity' figures"
_SRC_L4 = "NVIDIA L4 datasheet (l4-datasheet-2595652), dense = half of the 'with sparsity' figures"
_SRC_A10 = "NVIDIA A10 datasheet (a10-datasheet); A10G (AWS) taken as A10, dense figures"
_SRC_B200 = "NVIDIA DGX B200 datasheet: per-GPU = system / 8, dense = half of the 'with sparsity' figures"
_SRC_PRICE_DEFAULT = (
    "project default, not a provider's quote: the order of magnitude of on-demand cloud list prices; "
    "set hardware.price_per_device_hour for yours"
)
_USER_SET = "no default price: set hardware.price_per_device_hour"
# Host RAM of one node: the reference 8-GPU cloud instance of each device (AWS EC2 instance-type specifications;
# DGX datasheet for B200). Nodes differ: override with hardware.host_memory_gb for yours.
_HOST_UNKNOWN = "unknown: set hardware.host_memory_gb (RAM of one node) for a verdict on offloaded bytes"


def _host(instance: str, gib: int) -> tuple[int, str]:
    return gib * _GIB, f"reference node {instance} (8 GPUs, {gib} GiB RAM); override hardware.host_memory_gb"


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator model: what it can compute, hold and cost.

    Args:
        name: preset key (``h100_sxm``, ``cpu``, ...) or a free name.
        memory_bytes: device memory per device, ``None`` if unknown (CPU).
        peak_flops: dense peak FLOP/s per dtype key (see :data:`DTYPE_KEYS`); missing keys mean unknown.
        price_per_device_hour: dollars per device-hour, ``None`` when the user has not set one.
        sources: where each figure comes from (``peak``, ``price``, ``memory``, ``host_memory``).
        host_memory_bytes: host RAM of one node (what CPU offload fills, shared by the node's ranks), ``None`` if
            unknown.

    Example::

        spec = hardware_spec("a100_80gb", price_per_device_hour=4.1)
        spec.peak("bf16")  # 312e12
    """

    name: str
    memory_bytes: int | None = None
    peak_flops: dict[str, float] = field(default_factory=dict)
    price_per_device_hour: float | None = None
    sources: dict[str, str] = field(default_factory=dict)
    host_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for key, value in self.peak_flops.items():
            if key not in DTYPE_KEYS:
                raise ConfigError(
                    f"hardware.peak_tflops.{key}", value, f"use dtype keys among {', '.join(DTYPE_KEYS)}."
                )
            if not value > 0:
                raise ConfigError(f"hardware.peak_tflops.{key}", value, "use a positive TFLOP/s figure.")
        if self.price_per_device_hour is not None and self.price_per_device_hour < 0:
            raise ConfigError(
                "hardware.price_per_device_hour", self.price_per_device_hour, "use a price >= 0 in dollars per hour."
            )
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ConfigError("hardware.memory_gb", self.memory_bytes, "use a positive device memory size.")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ConfigError("hardware.host_memory_gb", self.host_memory_bytes, "use a positive host RAM size.")

    def peak(self, dtype_key: str) -> float | None:
        """Dense peak FLOP/s for ``dtype_key``; ``None`` when this device has no known figure."""
        return self.peak_flops.get(dtype_key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view for metrics.json."""
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "price_per_device_hour": self.price_per_device_hour,
            "host_memory_bytes": self.host_memory_bytes,
            "sources": dict(self.sources),
        }


def _tf(**tflops: float) -> dict[str, float]:
    return {k: v * 1e12 for k, v in tflops.items()}


def _spec(
    name: str,
    mem: int | None,
    peak: dict[str, float],
    src: str,
    price: float | None,
    price_src: str,
    host: tuple[int, str] | None = None,
) -> HardwareSpec:
    host_bytes, host_src = host if host else (None, _HOST_UNKNOWN)
    sources = {"peak": src, "memory": src, "price": price_src, "host_memory": host_src}
    return HardwareSpec(name, mem, peak, price, sources, host_bytes)


#: Built-in presets, keyed by the names of ``conf/hardware/*.yaml``.
HARDWARE: dict[str, HardwareSpec] = {
    "a100_40gb": _spec(
        "a100_40gb",
        40 * _GIB,
        _tf(fp64=19.5, fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624),
        _SRC_A100,
        3.5,
        _SRC_PRICE_DEFAULT,
        _host("p4d.24xlarge", 1152),
    ),
    "a100_80gb": _spec(
        "a100_80gb",
        80 * _GIB,
        _tf(fp64=19.5, fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624),
        _SRC_A100,
        4.8,
        _SRC_PRICE_DEFAULT,
        _host("p4de.24xlarge", 1152),
    ),
    "h100_sxm": _spec(
        "h100_sxm",
        80 * _GIB,
        _tf(fp64=66.9, fp32=66.9, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
        _SRC_H100,
        8.2,
        _SRC_PRICE_DEFAULT,
        _host("p5.48xlarge", 2048),
    ),
    "h100_pcie": _spec(
        "h100_pcie",
        80 * _GIB,
        _tf(fp64=51.2, fp32=51.2, tf32=378, bf16=756, fp16=756, fp8=1513, int8=1513),
        _SRC_H100,
        8.2,
        _SRC_PRICE_DEFAULT + " (H100 price)",
    ),
    "h200": _spec(
        "h200",
        141 * _GB,
        _tf(fp64=67, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
        _SRC_H200,
        None,
        _USER_SET,
        _host("p5e.48xlarge", 2048),
    ),
    "b200": _spec(
        "b200",
        180 * _GB,
        _tf(fp64=40, fp32=80, tf32=1100, bf16=2250, fp16=2250, fp8=4500, int8=4500),
        _SRC_B200,
        None,
        _USER_SET,
        (2048 * _GIB, "DGX B200 datasheet: 2 TB system memory (up to 4 TB); override hardware.host_memory_gb"),
    ),
    "l40s": _spec(
        "l40s",
        48 * _GIB,
        _tf(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733, int8=733),
        _SRC_L40S,
        None,
        _USER_SET,
        _host("g6e.48xlarge", 1536),
    ),
    "l4": _spec(
        "l4",
        24 * _GIB,
        _tf(fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5, int8=242.5),
        _SRC_L4,
        None,
        _USER_SET,
        _host("g6.48xlarge", 768),
    ),
    "a10g": _spec(
        "a10g",
        24 * _GIB,
        _tf(fp32=31.2, tf32=62.5, bf16=125, fp16=125, int8=250),
        _SRC_A10,
        None,
        _USER_SET,
        _host("g5.48xlarge", 768),
    ),
    "cpu": HardwareSpec(
        "cpu",
        None,
        {},
        None,
        {
            "peak": "unknown: set +hardware.peak_tflops.<dtype>=<TFLOP/s> for MFU on CPU",
            "memory": "unknown",
            "price": _USER_SET,
            "host_memory": _HOST_UNKNOWN,
        },
    ),
}

_ALIASES = {"h100": "h100_sxm", "a100": "a100_80gb", "a10": "a10g"}

# (regex on the lowercased CUDA device name, preset); first match wins, so specific patterns come first.
# NVL cards (H100 NVL, H200 NVL) run at a lower power limit than the SXM parts, so their dense peaks are not in this
# table: they map to no preset (MFU then needs hardware.peak_tflops) rather than to an SXM peak ~18% too high.
# H800 / A800 are the export variants of H100 / A100 with the same compute (only NVLink bandwidth is cut).
_DEVICE_PATTERNS: tuple[tuple[str, str | None], ...] = (
    (r"\bnvl\b", None),
    (r"h200", "h200"),
    (r"b200", "b200"),
    (r"h[18]00.*pcie", "h100_pcie"),
    (r"h[18]00", "h100_sxm"),
    (r"a[18]00.*(80|sxm4-80)", "a100_80gb"),
    (r"a[18]00", "a100_40gb"),
    (r"l40s", "l40s"),
    (r"\bl4\b", "l4"),
    (r"a10g?\b", "a10g"),
)


def preset_for_device_name(device_name: str, total_memory_bytes: int | None = None) -> str | None:
    """Preset key for a CUDA device name such as ``"NVIDIA A100-SXM4-80GB"``; ``None`` if unknown."""
    lowered = device_name.lower()
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, lowered):
            if key is None:
                return None
            # A100 names do not always carry the size; the memory decides.
            if key == "a100_40gb" and total_memory_bytes is not None and total_memory_bytes > 50 * _GIB:
                return "a100_80gb"
            return key
    return None


def _this_host_memory() -> int | None:
    """RAM of the machine this process runs on (``None`` where the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def detect_hardware() -> HardwareSpec:
    """The preset of this process's current CUDA device, or ``cpu`` (unknown CUDA devices keep only their memory).

    The host RAM is this machine's, whatever the preset's reference node has.
    """
    import torch

    host = _this_host_memory()
    host_src = "this machine's RAM (hardware=auto)" if host else _HOST_UNKNOWN
    if not torch.cuda.is_available():
        spec = HARDWARE["cpu"]
        return replace(spec, host_memory_bytes=host, sources={**spec.sources, "host_memory": host_src})
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    key = preset_for_device_name(props.name, props.total_memory)
    if key is None:
        sources = {"peak": "unknown device", "price": _USER_SET, "host_memory": host_src}
        return HardwareSpec(props.name, props.total_memory, {}, None, sources, host)
    spec = HARDWARE[key]
    return replace(
        spec,
        memory_bytes=props.total_memory,
        host_memory_bytes=host,
        sources={**spec.sources, "host_memory": host_src},
    )


def hardware_spec(
    name: str = "auto",
    price_per_device_hour: float | None = None,
    peak_tflops: dict[str, float] | None = None,
    memory_gb: float | None = None,
    host_memory_gb: float | None = None,
) -> HardwareSpec:
    """Build a :class:`HardwareSpec` from a preset name with user overrides (the ``_target_`` of ``conf/hardware``).

    Args:
        name: a key of :data:`HARDWARE` (or ``h100``/``a100``/``a10``), or ``auto`` to detect the current device.
        price_per_device_hour: override the price (dollars per device-hour).
        peak_tflops: override peaks per dtype key, in TFLOP/s, e.g. ``{"bf16": 800}``.
        memory_gb: override the device memory in GiB.
        host_memory_gb: override the host RAM of one node in GiB (what CPU offload fills).

    Raises:
        ConfigError: unknown preset name or bad override.
    """
    if name == "auto":
        spec = detect_hardware()
    else:
        key = _ALIASES.get(name, name)
        if key not in HARDWARE:
            raise ConfigError("hardware.name", name, f"use auto or one of {', '.join(sorted(HARDWARE))}.")
        spec = HARDWARE[key]
    sources = dict(spec.sources)
    peaks = dict(spec.peak_flops)
    if peak_tflops:
        for key, value in dict(peak_tflops).items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"hardware.peak_tflops.{key}", value, "use a positive TFLOP/s figure.")
            peaks[key] = float(value) * 1e12
        sources["peak"] = f"user-set ({', '.join(sorted(dict(peak_tflops)))}); others: {spec.sources.get('peak')}"
    price = spec.price_per_device_hour
    if price_per_device_hour is not None:
        if isinstance(price_per_device_hour, bool) or not isinstance(price_per_device_hour, (int, float)):
            raise ConfigError(
                "hardware.price_per_device_hour",
                price_per_device_hour,
                "use dollars per device-hour as a number >= 0, e.g. 2.5.",
            )
        price = float(price_per_device_hour)
        sources["price"] = "user-set"
    memory = spec.memory_bytes
    if memory_gb is not None:
        if isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not memory_gb > 0:
            raise ConfigError("hardware.memory_gb", memory_gb, "use a positive size in GiB.")
        memory = int(memory_gb * _GIB)
        sources["memory"] = "user-set"
    host = spec.host_memory_bytes
    if host_memory_gb is not None:
        if isinstance(host_memory_gb, bool) or not isinstance(host_memory_gb, (int, float)) or not host_memory_gb > 0:
            raise ConfigError("hardware.host_memory_gb", host_memory_gb, "use the RAM of one node in GiB, e.g. 1024.")
        host = int(host_memory_gb * _GIB)
        sources["host_memory"] = "user-set"
    return HardwareSpec(spec.name, memory, peaks, price, sources, host)


def compute_dtype_key(trainer_precision: str, on_cuda: bool, float32_matmul_precision: str = "highest") -> str:
    """Peak-table key of the matmul dtype a Trainer precision runs in.

    ``32-true`` counts as ``tf32`` on CUDA when ``torch.set_float32_matmul_precision`` allows TF32.
    """
    p = str(trainer_precision)
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p == "transformer-engine" or "fp8" in p:
        return "fp8"
    if p.startswith("64"):
        return "fp64"
    if on_cuda and float32_matmul_precision != "highest":
        return "tf32"
    return "fp32"
