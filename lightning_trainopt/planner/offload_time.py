"""Seconds an optimizer step spends on what the FLOPs model does not see: offload copies, CPU Adam, NVMe swaps and
int8 activation compression, from the bytes the memory estimate places and the hardware's bandwidths.

Per device and optimizer step, with ``k`` micro-batches, ``P = ceil(parameters / world size)`` and ``g`` the bytes of
the dtype DeepSpeed keeps weights and gradients in (2 for half, 4 for fp32):

- Activation offload (``transforms/offload.py``): each saved tensor goes to pinned host memory in the forward and
  comes back in the backward, ``2 x A`` bytes per micro-batch (``A`` the activation bytes the estimate puts on the
  CPU). Both copies are issued on the compute stream (``non_blocking`` frees the CPU thread, not the GPU stream), so
  the GPU waits for them: serial.
- int8 compression (``transforms/compression.py``): eager quantise and dequantise kernels over every compressed
  element, counted kernel by kernel at ``a`` bytes per element of the original tensor: ``aminmax`` reads ``a``,
  ``float()`` ``a + 4`` (half only), ``abs`` 8, ``amax`` 4, ``/`` 8, ``round`` 8, ``clamp_`` 8, ``to(int8)`` 5;
  then ``float()`` 5, ``*`` 8, ``to(dtype)`` ``4 + a`` (half only): ``54 + a (+ 2a + 8 for half)`` B, 68 B for a
  half element, 58 B for fp32, at the device's memory bandwidth, on the compute stream: serial. The elements are
  the compressed bytes over ``1 + 4 / block`` (int8 codes plus an fp32 scale per block).
- DeepSpeed optimizer offload (``stage_1_and_2.py``, ``stage3.py``): each rank copies its gradient partition to the
  host converted to fp32 on the device (``4P``), and with accumulation (ZeRO-3: always) also moves the ``g``-byte
  partition to the host after every micro-batch and back before the next (``async_accumulate_grad_in_cpu_via_gpu``,
  ``partition_grads``): asynchronous copies during backward, overlapped with compute. Then CPU Adam updates ``P``
  parameters per rank while the device waits, the node's ranks sharing its cores (``P x devices per node`` at the
  node's rate), and ZeRO-1/2, or ZeRO-3 without parameter offload, copies the updated ``g``-byte partition back
  before the next forward: serial.
- ZeRO-3 parameter offload and FSDP2 CPU offload: each forward and each backward fetches the rank's parameters from
  the host (the ``params`` bytes the estimate puts on the CPU or NVMe, ``2k`` times per step), prefetched on a side
  stream: overlapped. FSDP2 also moves its fp32 gradient shards to the host after every backward (overlapped) and
  steps torch's fused AdamW on the CPU (``P`` parameters, at the CPU Adam rate, which it matched when measured):
  serial.
- ZeRO-Infinity (NVMe): the optimizer's NVMe bytes (fp32 master, moments, fp32 gradients) are written and read once
  per step (``2 x``), parameters kept on NVMe are read for every forward and backward and written after the step
  (``2k + 1``), all ranks of a node sharing its drives: serial (DeepSpeed's ``pipeline_read``/``pipeline_write``
  are off by default).

Step time = ``max(compute, overlapped PCIe time) + serial time``; the overlapped copies of each direction run on their
own copy engine, so their PCIe time is ``max(device -> host, host -> device) / bandwidth``. Where the device is the
host (planning for ``hardware=cpu``) nothing crosses PCIe and the optimizer runs on the CPU either way: only int8
compression and NVMe are charged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.activations import ActivationPolicy
from lightning_trainopt.planner.model_states import StrategyLayout
from lightning_trainopt.planner.terms import MemoryEstimate

__all__ = ["Bandwidths", "StepOverhead", "estimate_step_overhead", "int8_bytes_moved_per_element"]

_GB = 1e9
D2H, H2D = "PCIe device -> host", "PCIe host -> device"


@dataclass(frozen=True)
class Bandwidths:
    """The rates the overhead is charged at (``None``: unknown, that item is not charged and says which key to set).

    Args:
        pcie_bytes_per_s: one device's host link, bytes/s in each direction (``hardware.pcie_gb_per_s``).
        memory_bytes_per_s: one device's memory bandwidth, bytes/s (``hardware.memory_gb_per_s``).
        nvme_bytes_per_s: one node's NVMe drives together, bytes/s (``hardware.nvme_gb_per_s``).
        cpu_adam_params_per_s: parameters per second CPU Adam updates on one node, all its ranks together
            (``hardware.cpu_adam_params_per_s``).
        nvlink_bytes_per_s: one device's NVLink, bytes/s in each direction, for TP collectives inside a node
            (``hardware.nvlink_gb_per_s``).
        network_bytes_per_s: one device's share of the node's network, bytes/s each way, for TP collectives across
            nodes (``hardware.network_gb_per_s``).

    Raises:
        ConfigError: a rate that is not positive.
    """

    pcie_bytes_per_s: float | None = None
    memory_bytes_per_s: float | None = None
    nvme_bytes_per_s: float | None = None
    cpu_adam_params_per_s: float | None = None
    nvlink_bytes_per_s: float | None = None
    network_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        for key, value, unit in (
            ("pcie_gb_per_s", self.pcie_bytes_per_s, _GB),
            ("memory_gb_per_s", self.memory_bytes_per_s, _GB),
            ("nvme_gb_per_s", self.nvme_bytes_per_s, _GB),
            ("cpu_adam_params_per_s", self.cpu_adam_params_per_s, 1.0),
            ("nvlink_gb_per_s", self.nvlink_bytes_per_s, _GB),
            ("network_gb_per_s", self.network_bytes_per_s, _GB),
        ):
            if value is not None and not 0 < value < math.inf:
                raise ConfigError(f"hardware.{key}", value / unit, "use a positive, finite rate.")


@dataclass(frozen=True)
class StepOverhead:
    """Seconds per optimizer step on one device beyond the FLOPs model.

    Args:
        overlapped: ``PCIe device -> host`` / ``PCIe host -> device`` -> seconds of copies that run beside compute.
        serial: item -> seconds the device waits for (added to the step).
        formulas: item -> how its seconds were derived.
        not_charged: items that could not be charged, each naming the hardware key that would charge it.

    Example::

        overhead.step_time(compute_s=2.0)  # max(2.0, overlapped) + serial
    """

    overlapped: dict[str, float] = field(default_factory=dict)
    serial: dict[str, float] = field(default_factory=dict)
    formulas: dict[str, str] = field(default_factory=dict)
    not_charged: tuple[str, ...] = ()

    @property
    def overlapped_s(self) -> float:
        """PCIe time of the copies beside compute: each direction has its own copy engine."""
        return max(self.overlapped.values(), default=0.0)

    @property
    def serial_s(self) -> float:
        return sum(self.serial.values())

    def step_time(self, compute_s: float) -> float:
        """``max(compute, overlapped) + serial``."""
        return max(compute_s, self.overlapped_s) + self.serial_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "overlapped_s": dict(self.overlapped),
            "serial_s": dict(self.serial),
            "formulas": dict(self.formulas),
            "not_charged": list(self.not_charged),
        }


def int8_bytes_moved_per_element(elem_bytes: int) -> int:
    """Device-memory bytes the eager int8 quantise + dequantise kernels move per element of a saved tensor.

    Args:
        elem_bytes: bytes per element of the original tensor (2 half, 4 fp32).
    """
    half = elem_bytes < 4
    quantise = elem_bytes + (elem_bytes + 4 if half else 0) + 8 + 4 + 8 + 8 + 8 + 5
    dequantise = 5 + 8 + (4 + elem_bytes if half else 0)
    return quantise + dequantise


def _gb(n: float) -> str:
    return f"{n / _GB:,.3g} GB"


def estimate_step_overhead(
    memory: MemoryEstimate,
    *,
    n_params: int,
    world_size: int,
    devices_per_node: int,
    accumulate: int,
    layout: StrategyLayout,
    activations: ActivationPolicy,
    compute_bytes: int,
    bandwidths: Bandwidths,
    device_is_host: bool = False,
) -> StepOverhead:
    """Charge one device's optimizer step for offload, compression and NVMe (see the module docstring).

    Args:
        memory: the configuration's per-device memory estimate (where it puts activations, parameters and states).
        n_params: parameters the optimizer steps: the model's, or only an adapter's.
        world_size: devices in the job.
        devices_per_node: ranks sharing one node's CPU cores and NVMe drives.
        accumulate: micro-batches per optimizer step.
        layout: the strategy (offload places, ZeRO stage).
        activations: the activation policy (offload, int8 compression).
        compute_bytes: bytes of the compute dtype (2 half, 4 fp32).
        bandwidths: the rates to charge at.
        device_is_host: the planned device is the CPU: nothing crosses PCIe, the optimizer runs there anyway.
    """
    k = accumulate
    overlapped = {D2H: 0.0, H2D: 0.0}
    serial: dict[str, float] = {}
    formulas: dict[str, str] = {}
    missing: list[str] = []
    pcie, mem_bw = bandwidths.pcie_bytes_per_s, bandwidths.memory_bytes_per_s
    nvme, adam = bandwidths.nvme_bytes_per_s, bandwidths.cpu_adam_params_per_s
    over_bytes = {D2H: 0.0, H2D: 0.0}
    over_what: dict[str, list[str]] = {D2H: [], H2D: []}

    def charge(name: str, amount: float, rate: float | None, key: str, formula: str, per: str) -> None:
        """A serial phase of ``amount / rate`` seconds; a missing rate names the hardware key that sets it."""
        if device_is_host or not amount:
            return
        if rate is None:
            missing.append(f"{name} (set hardware.{key})")
            return
        serial[name] = amount / rate
        formulas[name] = f"{formula} = {per}"

    def link(name: str, nbytes: float, formula: str) -> None:
        per = f"{_gb(nbytes)} / {_gb(pcie)}/s" if pcie else ""
        charge(name, nbytes, pcie, "pcie_gb_per_s", formula, per)

    def beside(direction: str, nbytes: float, formula: str) -> None:
        if device_is_host or not nbytes:
            return
        over_bytes[direction] += nbytes
        over_what[direction].append(formula)

    def cpu_step(name: str, params_per_node: float, formula: str) -> None:
        per = f"{params_per_node:,.4g} params / {adam:,.3g} params/s" if adam else ""
        charge(name, params_per_node, adam, "cpu_adam_params_per_s", formula, per)

    # Saved activations: offloaded over PCIe, or compressed and decompressed in device memory.
    act_cpu = memory.bytes("activations", "cpu")
    if activations.offload:
        link("activation offload", 2 * act_cpu * k, f"2 x {_gb(act_cpu)} saved x {k} micro-batches")
    if activations.compress_bits:
        act = memory.bytes("activations")
        block = activations.compress_block
        elements = act * block / (block + 4)
        moved = int8_bytes_moved_per_element(compute_bytes)
        name = "int8 activation compression"
        if mem_bw is None:
            missing.append(f"{name} (set hardware.memory_gb_per_s)")
        else:
            serial[name] = elements * moved * k / mem_bw
            formulas[name] = (
                f"{elements:,.4g} elements x {moved} B moved x {k} micro-batches = "
                f"{_gb(elements * moved * k)} / {_gb(mem_bw)}/s"
            )

    per_rank = math.ceil(n_params / world_size)
    params_off = memory.bytes("params", "cpu") + memory.bytes("params", "nvme")
    if layout.steps_cpu_adam:
        g = compute_bytes
        every_micro = layout.shards_params or k > 1
        beside(D2H, 4 * per_rank, f"fp32 gradient partition 4 B x {per_rank:,}")
        if every_micro:
            beside(D2H, g * per_rank * k, f"{g} B gradient partition x {k} micro-batches")
        if k > 1:
            beside(H2D, g * per_rank * (k - 1), f"{g} B gradient partition back x {k - 1} micro-batches")
        if layout.offloads_params:
            beside(H2D, 2 * k * params_off, f"parameter fetches 2 x {k} x {_gb(params_off)}")
        else:
            link("updated parameters to the device", g * per_rank, f"{g} B x {per_rank:,} partition")
        cpu_step("CPU Adam", per_rank * devices_per_node, f"{per_rank:,} x {devices_per_node} ranks per node")
    elif layout.shards_each_param and layout.offloads_params:
        grads = memory.bytes("grads", "cpu")
        beside(H2D, 2 * k * params_off, f"parameter shard fetches 2 x {k} x {_gb(params_off)}")
        beside(D2H, k * grads, f"gradient shards {k} x {_gb(grads)}")
        cpu_step("CPU AdamW (fused)", per_rank * devices_per_node, f"{per_rank:,} x {devices_per_node} ranks per node")

    nvme_state = memory.bytes("grads", "nvme") + memory.bytes("optimizer_states", "nvme")
    nvme_params = memory.bytes("params", "nvme")
    nvme_bytes = (2 * nvme_state + (2 * k + 1) * nvme_params) * devices_per_node
    if nvme_bytes:
        name = "NVMe swaps"
        if nvme is None:
            missing.append(f"{name} (set hardware.nvme_gb_per_s)")
        else:
            serial[name] = nvme_bytes / nvme
            formulas[name] = (
                f"(2 x {_gb(nvme_state)} states + {2 * k + 1} x {_gb(nvme_params)} params) x {devices_per_node} "
                f"ranks per node = {_gb(nvme_bytes)} / {_gb(nvme)}/s"
            )

    if any(over_bytes.values()):
        if pcie is None:
            missing.append("offload copies beside compute (set hardware.pcie_gb_per_s)")
        else:
            for direction, nbytes in over_bytes.items():
                if nbytes:
                    overlapped[direction] = nbytes / pcie
                    formulas[direction] = f"{' + '.join(over_what[direction])} = {_gb(nbytes)} / {_gb(pcie)}/s"
    return StepOverhead({d: s for d, s in overlapped.items() if s}, serial, formulas, tuple(dict.fromkeys(missing)))
