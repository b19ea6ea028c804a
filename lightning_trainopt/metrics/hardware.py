"""Device facts as data: dense peak FLOP/s per dtype, memory, price per device-hour, bandwidths, each with a source.

Figures are *dense* tensor-core peaks (NVIDIA datasheets quote "with sparsity" figures at twice these).
Bandwidths are what the planner charges offload and compression with: the device's memory, its PCIe link to the
host, the node's NVMe drives and the node's CPU Adam rate.
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


# Bandwidths (GB = 1e9 B). PCIe: the datasheets quote both directions together; one direction is half of it, and
# that is the link rate, an upper bound on what pinned copies reach. Device memory: the datasheet figure.
def _pcie(doc: str, gen: int, both_ways_gb: float) -> tuple[float, str]:
    each = both_ways_gb / 2
    return each * _GB, (
        f"{doc}: PCIe Gen{gen} x16 {both_ways_gb:g} GB/s both directions = {each:g} GB/s each way (the link rate, "
        "an upper bound on pinned copies); override hardware.pcie_gb_per_s"
    )


def _mem_bw(doc: str, gb_per_s: float) -> tuple[float, str]:
    source = f"{doc}: {gb_per_s:,g} GB/s device memory bandwidth; override hardware.memory_gb_per_s"
    return float(gb_per_s) * _GB, source


_NVME_DEFAULT = (
    8.0 * _GB,
    "project default, not a measurement of your node: 8 GB/s for all the node's local NVMe drives together; "
    "measure yours on strategy.nvme_path (DeepSpeed's ds_nvme_tune) and set hardware.nvme_gb_per_s",
)
# bench/cpu_adam_throughput.py on the development VM (one Xeon core, AVX-512): 3.2e8 parameters/s with deepspeed
# 0.19.8's cpu_adam op (torch's fused CPU AdamW: 2.8e8/s). A node's ranks share its cores and DRAM; at ~28 B moved
# per update, 32 such cores need ~290 GB/s, about what a two-socket server's DRAM gives, so more cores do not help.
_CPU_ADAM_DEFAULT = (
    1e10,
    "derived from a measurement, not of your node: DeepSpeed CPU Adam ran 3.2e8 params/s on one Xeon core "
    "(bench/cpu_adam_throughput.py) x 32 cores = 1e10 params/s for the whole node, near where its ~28 B per update "
    "meet a two-socket server's DRAM bandwidth; measure yours and set hardware.cpu_adam_params_per_s",
)
_UNKNOWN_BW = {
    "pcie": "unknown: set hardware.pcie_gb_per_s (GB/s each way) to charge offload traffic",
    "memory_bandwidth": "unknown: set hardware.memory_gb_per_s to charge int8 activation compression",
    "nvme": "unknown: set hardware.nvme_gb_per_s (the node's NVMe GB/s) to charge ZeRO-Infinity's swaps",
    "cpu_adam": "unknown: set hardware.cpu_adam_params_per_s (the node's CPU Adam rate) to charge optimizer offload",
}


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator model: what it can compute, hold and cost.

    Args:
        name: preset key (``h100_sxm``, ``cpu``, ...) or a free name.
        memory_bytes: device memory per device, ``None`` if unknown (CPU).
        peak_flops: dense peak FLOP/s per dtype key (see :data:`DTYPE_KEYS`); missing keys mean unknown.
        price_per_device_hour: dollars per device-hour, ``None`` when the user has not set one.
        sources: where each figure comes from (``peak``, ``price``, ``memory``, ``host_memory``, ``pcie``,
            ``memory_bandwidth``, ``nvme``, ``cpu_adam``).
        host_memory_bytes: host RAM of one node (what CPU offload fills, shared by the node's ranks), ``None`` if
            unknown.
        pcie_bytes_per_s: one device's host link, bytes/s in each direction (``None``: unknown).
        memory_bytes_per_s: one device's memory bandwidth, bytes/s (``None``: unknown).
        nvme_bytes_per_s: the NVMe drives of one node together, bytes/s, shared by its ranks (``None``: unknown).
        cpu_adam_params_per_s: parameters per second CPU Adam updates on one node, all its ranks together
            (``None``: unknown).
        nvlink_bytes_per_s: one device's NVLink, bytes/s in each direction, for tensor-parallel collectives inside
            a node (``None``: unknown or no NVLink).
        network_bytes_per_s: one device's share of its node's network, bytes/s each way, for tensor-parallel
            collectives across nodes (``None``: unknown).

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
    pcie_bytes_per_s: float | None = None
    memory_bytes_per_s: float | None = None
    nvme_bytes_per_s: float | None = None
    cpu_adam_params_per_s: float | None = None
    nvlink_bytes_per_s: float | None = None
    network_bytes_per_s: float | None = None

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
        for rate_key, rate in (
            ("pcie_gb_per_s", self.pcie_bytes_per_s),
            ("memory_gb_per_s", self.memory_bytes_per_s),
            ("nvme_gb_per_s", self.nvme_bytes_per_s),
            ("nvlink_gb_per_s", self.nvlink_bytes_per_s),
            ("network_gb_per_s", self.network_bytes_per_s),
        ):
            if rate is not None and not rate > 0:
                raise ConfigError(f"hardware.{rate_key}", rate / _GB, "use a positive bandwidth in GB/s.")
        if self.cpu_adam_params_per_s is not None and not self.cpu_adam_params_per_s > 0:
            raise ConfigError(
                "hardware.cpu_adam_params_per_s", self.cpu_adam_params_per_s, "use a positive rate, e.g. 1e10."
            )

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
            "pcie_gb_per_s": _per_gb(self.pcie_bytes_per_s),
            "memory_gb_per_s": _per_gb(self.memory_bytes_per_s),
            "nvme_gb_per_s": _per_gb(self.nvme_bytes_per_s),
            "cpu_adam_params_per_s": self.cpu_adam_params_per_s,
            "nvlink_gb_per_s": _per_gb(self.nvlink_bytes_per_s),
            "network_gb_per_s": _per_gb(self.network_bytes_per_s),
            "sources": dict(self.sources),
        }


def _per_gb(bytes_per_s: float | None) -> float | None:
    return None if bytes_per_s is None else bytes_per_s / _GB


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
    pcie: tuple[float, str] | None = None,
    mem_bw: tuple[float, str] | None = None,
) -> HardwareSpec:
    host_bytes, host_src = host if host else (None, _HOST_UNKNOWN)
    sources = {"peak": src, "memory": src, "price": price_src, "host_memory": host_src}
    figures: dict[str, float | None] = {}
    given = {"pcie": pcie, "memory_bandwidth": mem_bw, "nvme": _NVME_DEFAULT, "cpu_adam": _CPU_ADAM_DEFAULT}
    for key, pair in given.items():
        figures[key], sources[key] = pair if pair else (None, _UNKNOWN_BW[key])
    return HardwareSpec(
        name,
        mem,
        peak,
        price,
        sources,
        host_bytes,
        pcie_bytes_per_s=figures["pcie"],
        memory_bytes_per_s=figures["memory_bandwidth"],
        nvme_bytes_per_s=figures["nvme"],
        cpu_adam_params_per_s=figures["cpu_adam"],
    )


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
        pcie=_pcie("NVIDIA A100 datasheet", 4, 64),
        mem_bw=_mem_bw("NVIDIA A100 datasheet (40GB SXM)", 1555),
    ),
    "a100_80gb": _spec(
        "a100_80gb",
        80 * _GIB,
        _tf(fp64=19.5, fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624),
        _SRC_A100,
        4.8,
        _SRC_PRICE_DEFAULT,
        _host("p4de.24xlarge", 1152),
        pcie=_pcie("NVIDIA A100 datasheet", 4, 64),
        mem_bw=_mem_bw("NVIDIA A100 datasheet (80GB SXM)", 2039),
    ),
    "h100_sxm": _spec(
        "h100_sxm",
        80 * _GIB,
        _tf(fp64=66.9, fp32=66.9, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
        _SRC_H100,
        8.2,
        _SRC_PRICE_DEFAULT,
        _host("p5.48xlarge", 2048),
        pcie=_pcie("NVIDIA H100 datasheet", 5, 128),
        mem_bw=_mem_bw("NVIDIA H100 datasheet (SXM)", 3350),
    ),
    "h100_pcie": _spec(
        "h100_pcie",
        80 * _GIB,
        _tf(fp64=51.2, fp32=51.2, tf32=378, bf16=756, fp16=756, fp8=1513, int8=1513),
        _SRC_H100,
        8.2,
        _SRC_PRICE_DEFAULT + " (H100 price)",
        pcie=_pcie("NVIDIA H100 datasheet", 5, 128),
        mem_bw=_mem_bw("NVIDIA H100 datasheet (PCIe)", 2000),
    ),
    "h200": _spec(
        "h200",
        141 * _GB,
        _tf(fp64=67, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
        _SRC_H200,
        None,
        _USER_SET,
        _host("p5e.48xlarge", 2048),
        pcie=_pcie("NVIDIA H200 datasheet", 5, 128),
        mem_bw=_mem_bw("NVIDIA H200 datasheet (SXM)", 4800),
    ),
    "b200": _spec(
        "b200",
        180 * _GB,
        _tf(fp64=40, fp32=80, tf32=1100, bf16=2250, fp16=2250, fp8=4500, int8=4500),
        _SRC_B200,
        None,
        _USER_SET,
        (2048 * _GIB, "DGX B200 datasheet: 2 TB system memory (up to 4 TB); override hardware.host_memory_gb"),
        pcie=_pcie("the PCIe Gen5 host CPUs of DGX B200 (the datasheet gives no per-GPU host link)", 5, 128),
        mem_bw=_mem_bw("NVIDIA DGX B200 datasheet: 64 TB/s HBM3e / 8 GPUs", 8000),
    ),
    "l40s": _spec(
        "l40s",
        48 * _GIB,
        _tf(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733, int8=733),
        _SRC_L40S,
        None,
        _USER_SET,
        _host("g6e.48xlarge", 1536),
        pcie=_pcie("NVIDIA L40S datasheet", 4, 64),
        mem_bw=_mem_bw("NVIDIA L40S datasheet", 864),
    ),
    "l4": _spec(
        "l4",
        24 * _GIB,
        _tf(fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5, int8=242.5),
        _SRC_L4,
        None,
        _USER_SET,
        _host("g6.48xlarge", 768),
        pcie=_pcie("NVIDIA L4 datasheet", 4, 64),
        mem_bw=_mem_bw("NVIDIA L4 datasheet", 300),
    ),
    "a10g": _spec(
        "a10g",
        24 * _GIB,
        _tf(fp32=31.2, tf32=62.5, bf16=125, fp16=125, int8=250),
        _SRC_A10,
        None,
        _USER_SET,
        _host("g5.48xlarge", 768),
        pcie=_pcie("NVIDIA A10 datasheet", 4, 64),
        mem_bw=_mem_bw("NVIDIA A10 datasheet", 600),
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
            **_UNKNOWN_BW,
        },
    ),
}

_ALIASES = {"h100": "h100_sxm", "a100": "a100_80gb", "a10": "a10g"}


def _link(doc: str, both_ways_gb: float) -> tuple[float, str]:
    each = both_ways_gb / 2
    return each * _GB, (
        f"{doc}: NVLink {both_ways_gb:g} GB/s per GPU both directions = {each:g} GB/s each way (the link rate, an "
        "upper bound on what NCCL's collectives reach); override hardware.nvlink_gb_per_s"
    )


def _net(instance: str, node_gbit: float) -> tuple[float, str]:
    each = node_gbit / 8 / 8
    return each * _GB, (
        f"reference node {instance}: {node_gbit:g} Gbit/s network for 8 GPUs = {each:g} GB/s per GPU each way; "
        "override hardware.network_gb_per_s"
    )


#: Interconnects of the presets with NVLink among 8 GPUs (datasheets) and the network of their reference node (AWS
#: EC2 instance-type specifications; DGX B200 datasheet), for the planner's tensor-parallel collectives.
_INTERCONNECT: dict[str, dict[str, tuple[float, str]]] = {
    "a100_40gb": {"nvlink": _link("NVIDIA A100 datasheet (SXM)", 600), "network": _net("p4d.24xlarge", 400)},
    "a100_80gb": {"nvlink": _link("NVIDIA A100 datasheet (SXM)", 600), "network": _net("p4de.24xlarge", 400)},
    "h100_sxm": {"nvlink": _link("NVIDIA H100 datasheet (SXM)", 900), "network": _net("p5.48xlarge", 3200)},
    "h200": {"nvlink": _link("NVIDIA H200 datasheet (SXM)", 900), "network": _net("p5e.48xlarge", 3200)},
    "b200": {"nvlink": _link("NVIDIA DGX B200 datasheet", 1800), "network": _net("DGX B200 (8 x 400 Gbit/s)", 3200)},
}
_UNKNOWN_LINK = {
    "nvlink": "unknown or no NVLink: set hardware.nvlink_gb_per_s to charge tensor-parallel collectives in a node",
    "network": "unknown: set hardware.network_gb_per_s (per GPU, each way) to charge TP collectives across nodes",
}


def _with_interconnect(spec: HardwareSpec) -> HardwareSpec:
    links = _INTERCONNECT.get(spec.name, {})
    sources = dict(spec.sources)
    rates: dict[str, float | None] = {}
    for key in ("nvlink", "network"):
        pair = links.get(key)
        rates[key], sources[key] = pair if pair else (None, _UNKNOWN_LINK[key])
    return replace(spec, nvlink_bytes_per_s=rates["nvlink"], network_bytes_per_s=rates["network"], sources=sources)


for _name in list(HARDWARE):
    HARDWARE[_name] = _with_interconnect(HARDWARE[_name])

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
        sources = {"peak": "unknown device", "price": _USER_SET, "host_memory": host_src, **_UNKNOWN_BW}
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
    pcie_gb_per_s: float | None = None,
    memory_gb_per_s: float | None = None,
    nvme_gb_per_s: float | None = None,
    cpu_adam_params_per_s: float | None = None,
    nvlink_gb_per_s: float | None = None,
    network_gb_per_s: float | None = None,
) -> HardwareSpec:
    """Build a :class:`HardwareSpec` from a preset name with user overrides (the ``_target_`` of ``conf/hardware``).

    Args:
        name: a key of :data:`HARDWARE` (or ``h100``/``a100``/``a10``), or ``auto`` to detect the current device.
        price_per_device_hour: override the price (dollars per device-hour).
        peak_tflops: override peaks per dtype key, in TFLOP/s, e.g. ``{"bf16": 800}``.
        memory_gb: override the device memory in GiB.
        host_memory_gb: override the host RAM of one node in GiB (what CPU offload fills).
        pcie_gb_per_s: override one device's host link, GB/s (1e9 B/s) in each direction.
        memory_gb_per_s: override one device's memory bandwidth, GB/s.
        nvme_gb_per_s: override the NVMe bandwidth of one node (all its drives, shared by its ranks), GB/s.
        cpu_adam_params_per_s: override the parameters per second CPU Adam updates on one node (all its ranks).
        nvlink_gb_per_s: override one device's NVLink, GB/s each way (tensor-parallel collectives in a node).
        network_gb_per_s: override one device's share of the node's network, GB/s each way (TP across nodes).

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
    rates = {
        "pcie": spec.pcie_bytes_per_s,
        "memory_bandwidth": spec.memory_bytes_per_s,
        "nvme": spec.nvme_bytes_per_s,
        "cpu_adam": spec.cpu_adam_params_per_s,
        "nvlink": spec.nvlink_bytes_per_s,
        "network": spec.network_bytes_per_s,
    }
    overrides = (
        ("pcie", "pcie_gb_per_s", pcie_gb_per_s, _GB, "use GB/s in each direction, e.g. 25 (PCIe Gen4 x16)."),
        ("memory_bandwidth", "memory_gb_per_s", memory_gb_per_s, _GB, "use the device's GB/s, e.g. 2039."),
        ("nvme", "nvme_gb_per_s", nvme_gb_per_s, _GB, "use the node's NVMe GB/s, e.g. 8."),
        ("cpu_adam", "cpu_adam_params_per_s", cpu_adam_params_per_s, 1, "use parameters per second, e.g. 1e10."),
        ("nvlink", "nvlink_gb_per_s", nvlink_gb_per_s, _GB, "use GB/s each way per GPU, e.g. 450 (H100 SXM)."),
        ("network", "network_gb_per_s", network_gb_per_s, _GB, "use GB/s each way per GPU, e.g. 50 (400 Gbit/s)."),
    )
    for what, key, given, unit, fix in overrides:
        if given is None:
            continue
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not 0 < given < float("inf"):
            raise ConfigError(f"hardware.{key}", given, fix)
        rates[what] = float(given) * unit
        sources[what] = "user-set"
    return HardwareSpec(
        spec.name,
        memory,
        peaks,
        price,
        sources,
        host,
        pcie_bytes_per_s=rates["pcie"],
        memory_bytes_per_s=rates["memory_bandwidth"],
        nvme_bytes_per_s=rates["nvme"],
        cpu_adam_params_per_s=rates["cpu_adam"],
        nvlink_bytes_per_s=rates["nvlink"],
        network_bytes_per_s=rates["network"],
    )


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
