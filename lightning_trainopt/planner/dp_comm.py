"""Data-parallel communication of one optimizer step: gradient reductions and parameter all-gathers, by strategy.

Per rank and optimizer step, with ``P`` the parameters a rank's TP share holds (the whole model without TP), ``k``
micro-batches, ``d`` data-parallel ranks, ``s`` the ranks one parameter is sharded over (``d``, or ``d / r`` under
HSDP with ``r`` replicas), ``w`` and ``g`` the bytes per element of the weights and gradients as they travel (4 for
fp32 weights under autocast and in fp32, 2 for half weights: ``-true`` and DeepSpeed, whose engine holds a half
module and reduces in it). A ring all-reduce sends ``2·(n-1)/n`` of the tensor per rank, an all-gather or a
reduce-scatter ``(n-1)/n`` (NCCL's bus-bandwidth model):

- DDP: one all-reduce of the gradients per step (Lightning skips the sync of the other micro-batches):
  ``2·(d-1)/d·P·g``; overlapped with backward (DDP's buckets).
- ZeRO-1: a reduce-scatter of the gradients at the accumulation boundary, overlapped with backward, and an
  all-gather of the updated weights after the optimizer step, which the next forward waits for:
  ``(d-1)/d·P·g`` overlapped + ``(d-1)/d·P·w`` serial.
- ZeRO-2: as ZeRO-1, but the gradients are reduce-scattered after every micro-batch's backward (``k`` times).
- ZeRO-3 and FSDP2: each micro-batch all-gathers the weights for forward and again for backward (once if the units
  keep them gathered after forward, ``reshard_after_forward=false``) and reduce-scatters the gradients:
  ``k·((2 or 1)·(s-1)/s·P·w + (s-1)/s·P·g)``, prefetched and reduced beside compute: overlapped.
- HSDP (``r`` > 1): also each micro-batch all-reduces the gradient shard between the replicas:
  ``k·2·(r-1)/r·P/s·g``; overlapped with backward.

With an adapter (LoRA/QLoRA) only its ``T`` parameters have gradients and optimizer states: every gradient term
and ZeRO's all-gather of the updated weights count ``T`` instead of ``P``; ZeRO-3/FSDP2 still all-gather the whole
(frozen) base, a QLoRA base as its packed 4-bit bytes (``gathered_bytes``).

Links: a group whose ranks sit in one node communicates over NVLink, one that spans nodes over the network (each
rank's share of the node's NICs), the slower hop setting the pace of a ring. Ranks are laid out as ParallelDims
lays them out (replicas outermost, TP innermost): a shard group spans ``s·tp`` consecutive ranks, the data-parallel
group of DDP/ZeRO and the replica group the whole job.

Overlap assumption: overlapped collectives run beside compute on their own link and cost the step only what exceeds
the compute time (``StepOverhead``: step = ``max(compute, each overlapped item) + serial``); the first all-gather
of a step and the last reduce before the optimizer step, which nothing hides, are not charged.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_trainopt.planner.model_states import StrategyLayout

__all__ = ["DPComm", "dp_comm"]


@dataclass(frozen=True)
class DPComm:
    """One data-parallel collective of a step on one rank.

    Args:
        label: the item, with its link (``FSDP all-gathers + reduce-scatters (NVLink)``).
        nbytes: bytes each rank sends per step.
        seconds: time at the link's bandwidth (``None``: the bandwidth is unknown).
        overlapped: runs beside compute (``True``) or the step waits for it.
        formula: how it was derived.
    """

    label: str
    nbytes: float
    seconds: float | None
    overlapped: bool
    formula: str


def _link(span: int, devices_per_node: int, nvlink: float | None, network: float | None) -> tuple[str, float | None]:
    return ("NVLink", nvlink) if span <= devices_per_node else ("network", network)


def dp_comm(
    layout: StrategyLayout,
    n_params: int,
    weight_bytes: int,
    grad_bytes: int,
    data_parallel: int,
    replicate: int,
    tp: int,
    devices_per_node: int,
    accumulate: int,
    nvlink_bytes_per_s: float | None,
    network_bytes_per_s: float | None,
    *,
    trainable: int | None = None,
    gathered_bytes: float | None = None,
) -> list[DPComm]:
    """The data-parallel collectives of one optimizer step on one rank (see the module docstring).

    Args:
        layout: the strategy.
        n_params: parameters one rank's TP share holds (the whole model without TP).
        weight_bytes: bytes per weight element as all-gathered.
        grad_bytes: bytes per gradient element as reduced.
        data_parallel: data-parallel ranks (``world / tp``).
        replicate: HSDP replicas (1: none).
        tp: tensor-parallel size (the innermost dimension of the rank layout).
        devices_per_node: ranks of one node.
        accumulate: micro-batches per optimizer step.
        nvlink_bytes_per_s: one device's NVLink bandwidth (``None``: unknown).
        network_bytes_per_s: one device's share of the network (``None``: unknown).
        trainable: parameters with gradients, of one rank's TP share (``None``: all ``n_params``; an adapter's).
        gathered_bytes: bytes of one rank's TP share of the weights as ZeRO-3/FSDP2 all-gather them (``None``:
            ``n_params x weight_bytes``; a QLoRA base travels as its packed 4-bit bytes).

    Returns:
        the collectives (empty with one data-parallel rank or without a strategy).
    """
    d, r, k, p = data_parallel, replicate, accumulate, n_params
    t = p if trainable is None else trainable  # the parameters whose gradients are reduced
    gathered = p * weight_bytes if gathered_bytes is None else gathered_bytes
    if d <= 1 or not layout.has_strategy:
        return []
    s = d // r
    gb = 1e9
    out: list[DPComm] = []

    def add(what: str, span: int, nbytes: float, overlapped: bool, formula: str) -> None:
        link, bw = _link(span, devices_per_node, nvlink_bytes_per_s, network_bytes_per_s)
        if bw is None:
            key = "nvlink_gb_per_s" if link == "NVLink" else "network_gb_per_s"
            out.append(DPComm(f"{what} ({link})", nbytes, None, overlapped, f"{formula}; set hardware.{key}"))
            return
        out.append(DPComm(f"{what} ({link})", nbytes, nbytes / bw, overlapped, f"{formula} / {bw / gb:g} GB/s {link}"))

    world = d * tp
    if layout.shards_params:
        if s > 1:
            gathers = 2 if layout.reshard_after_forward else 1
            nbytes = k * (gathers * (s - 1) / s * gathered + (s - 1) / s * t * grad_bytes)
            if t == p and gathered == p * weight_bytes:
                formula = (
                    f"{k} x ({gathers} all-gathers x {weight_bytes} B + reduce-scatter x {grad_bytes} B) x "
                    f"({s}-1)/{s} x {p:,} params"
                )
            else:
                formula = (
                    f"{k} x ({gathers} all-gathers x {gathered / gb:.3g} GB of weights + reduce-scatter x "
                    f"{grad_bytes} B x {t:,} trainable params) x ({s}-1)/{s}"
                )
            name = "FSDP2" if layout.shards_each_param else "ZeRO-3"
            add(f"{name} all-gathers + reduce-scatters", s * tp, nbytes, True, formula)
        if r > 1:
            shard = -(-t // s)
            nbytes = k * 2 * (r - 1) / r * shard * grad_bytes
            formula = f"{k} x all-reduce 2 x ({r}-1)/{r} x {shard:,} params (one shard) x {grad_bytes} B"
            add("HSDP replica all-reduce", world, nbytes, True, formula)
        return out
    if layout.shards_optimizer:  # ZeRO-1/2
        times = 1 if layout.reduces_at_boundary else k
        nbytes = times * (d - 1) / d * t * grad_bytes
        add("ZeRO gradient reduce-scatter", world, nbytes, True, f"{times} x ({d}-1)/{d} x {t:,} x {grad_bytes} B")
        nbytes = (d - 1) / d * t * weight_bytes
        add("ZeRO weight all-gather after the step", world, nbytes, False, f"({d}-1)/{d} x {t:,} x {weight_bytes} B")
        return out
    if layout.ddp_buckets:
        nbytes = 2 * (d - 1) / d * t * grad_bytes
        add("DDP gradient all-reduce", world, nbytes, True, f"2 x ({d}-1)/{d} x {t:,} x {grad_bytes} B")
    return out
