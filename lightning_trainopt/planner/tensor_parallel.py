"""Tensor and sequence parallelism in the planner: per-device model states, activations and TP communication.

For any model with a TP plan (``ModelProfile.tp_shape``: our GPT presets, Hugging Face Llama, Mistral and Qwen2),
whose split parameters ``ModelProfile.tp_split`` names (read from ``parallel/tp.py``'s module names on the meta
model); the sizes TP must divide are checked by :func:`~lightning_trainopt.planner.tp_shape.tp_divisibility_errors`,
the app's pre-flight check.

Megatron-style TP (column-parallel q/k/v and gate/up, row-parallel o/down, vocabulary-parallel head and loss)
splits every weight matrix over the ``t`` ranks of a TP group; norm vectors stay whole on each of them. The
data-parallel sharding (ZeRO/FSDP2) then divides what is left by the ranks of one shard group: all data-parallel
ranks, or under HSDP only those of one replica group (``dp / replicate``).

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), eq. 2-4:
per layer and micro-batch, with ``s`` tokens, ``b`` sequences, ``h`` hidden size, ``a`` heads (16-bit activations)

- no TP: ``s·b·h·(34 + 5·a·s/h)``;
- TP ``t`` alone: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``: the norm and dropout inputs (``10·s·b·h``) stay whole;
- TP with sequence parallelism: ``s·b·h·(34/t + 5·a·s/(h·t))``: everything is divided.

The ``5·a·s/h`` term is the attention scores, which flash / memory-efficient kernels (``sdpa``) do not keep. The
planner's own per-tensor breakdown of one block is scaled by the ratio of these formulas to the no-TP one; the head
and loss (loss-parallel: logits split over the vocabulary) and the autocast copies of the weights are divided by
``t``, a checkpointed block's input only under sequence parallelism (the residual stream is then split too).

Communication, per layer and micro-batch (Korthikanti et al., section 4.2.2): without SP two all-reduces in forward
and two in backward of the ``b·s·h`` activations; with SP an all-gather and a reduce-scatter in place of each, the
same bytes. A ring all-reduce moves ``2·(t-1)/t`` of the tensor per rank, an all-gather or reduce-scatter
``(t-1)/t``, so both give ``8·(t-1)/t·b·s·h·bytes`` per layer and micro-batch, and a checkpointed layer repeats its
forward's half. They sit on the critical path (async TP needs compile), at NVLink bandwidth when the TP group fits in
a node, at the network's otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner.fsdp_units import FSDPUnits
from lightning_trainopt.planner.model_profile import ModelProfile
from lightning_trainopt.planner.terms import MemoryEstimate
from lightning_trainopt.planner.tp_shape import TPShape, tp_divisibility_errors

#: What the TP formulas read of a model: our preset's shape, or the :class:`TPShape` of a model with a plan.
Shape = GPTConfig | TPShape

__all__ = [
    "TPComm",
    "korthikanti_layer_bytes",
    "tp_activations",
    "tp_comm",
    "tp_param_groups",
    "tp_profile",
    "tp_refusal",
]


def tp_refusal(model: Shape, tp: int, seq_len: int, sequence_parallel: bool) -> str:
    """Why TP ``tp`` cannot split ``model`` (the sizes a Megatron-style plan divides), or ``""`` when it can: the
    app's pre-flight check (:func:`~lightning_trainopt.planner.tp_shape.tp_divisibility_errors`)."""
    if tp == 1:
        return ""
    sizes = {"heads": model.n_heads, "kv_heads": model.kv_heads, "ffn": model.ffn_hidden, "vocab": model.vocab_size}
    bad = tp_divisibility_errors(sizes, tp, seq_len if sequence_parallel else None)
    return f"{', '.join(bad)} not divisible by tensor_parallel_size={tp}" if bad else ""


def tp_param_groups(
    groups: tuple[tuple[int, ...], ...], tp: int, split: tuple[tuple[bool, ...], ...] | None = None
) -> tuple[tuple[int, ...], ...]:
    """Elements per rank of each parameter under TP ``tp``.

    Args:
        groups: element counts per optimizer group (``ModelProfile.param_groups``).
        tp: tensor-parallel size.
        split: per parameter, whether the plan splits it (``ModelProfile.tp_split``); ``None``: the matrices (the
            first, decayed, group) split, the vectors of the other groups (norm weights) whole on every rank.
    """
    if tp == 1:
        return groups
    if split is None:
        first, *rest = groups
        return (tuple(-(-k // tp) for k in first), *rest)
    return tuple(
        tuple(-(-k // tp) if s else k for k, s in zip(g, f, strict=True)) for g, f in zip(groups, split, strict=True)
    )


def tp_profile(profile: ModelProfile, tp: int) -> ModelProfile:
    """``profile`` as one rank of a TP group holds it: matrices, FSDP units and the ZeRO-3 trace divided by ``tp``
    (norm vectors are a few thousand elements per block: the units are divided whole)."""
    if tp == 1:
        return profile
    units = profile.fsdp_units
    split = FSDPUnits(
        blocks=tuple(-(-k // tp) for k in units.blocks), root=-(-units.root // tp), head=-(-units.head // tp)
    )
    trace = tuple(tuple((i, -(-k // tp)) for i, k in step) for step in profile.module_trace)
    return replace(
        profile,
        param_groups=tp_param_groups(profile.param_groups, tp, profile.tp_split),
        fsdp_units=split,
        module_trace=trace,
        tied_numel=-(-profile.tied_numel // tp),
    )


def korthikanti_layer_bytes(
    seq_len: int, micro_batch: int, d_model: int, n_heads: int, tp: int, sequence_parallel: bool, scores: bool
) -> float:
    """Activation bytes of one transformer layer on one rank (Korthikanti et al. eq. 2-4, 16-bit activations).

    Args:
        scores: the attention kernel keeps the ``a·s·s`` scores (``math``); flash kernels do not.
    """
    s, b, h, a = seq_len, micro_batch, d_model, n_heads
    quad = 5 * a * s / h if scores else 0.0
    if tp == 1:
        per = 34 + quad
    elif sequence_parallel:
        per = 34 / tp + quad / tp
    else:
        per = 10 + 24 / tp + quad / tp
    return s * b * h * per


def tp_activations(
    acts: MemoryEstimate, model: Shape, micro_batch: int, seq_len: int, tp: int, sp: bool, attention: str
) -> MemoryEstimate:
    """The activations of one micro-batch on one rank of a TP group, from the planner's whole-model breakdown."""
    if tp == 1:
        return acts
    args = (seq_len, micro_batch, model.d_model, model.n_heads)
    ratio = korthikanti_layer_bytes(*args, tp, sp, attention == "math") / korthikanti_layer_bytes(
        *args, 1, sp, attention == "math"
    )
    split = 1 / tp
    out = []
    for t in acts.terms:
        label = t.label
        if t.category not in ("activations", "other") or t.nbytes == 0:
            out.append(t)
            continue
        if "token ids" in label or "fp32 copies of norm weights" in label or "pinned" in label:
            f, why = 1.0, ""
        elif "checkpointed block inputs" in label:
            f, why = (split, f" / {tp} (SP)") if sp else (1.0, "")
        elif "full blocks" in label or "recomputed block" in label or "measured" in label:
            # a measured profile's saved tensors are mostly its blocks'; its head's share is split either way
            f, why = ratio, f" x {ratio:.3g} (Korthikanti, TP {tp}{' + SP' if sp else ''})"
        elif t.category == "activations" or "logits" in label or "chunk" in label:
            # head and loss (vocabulary-parallel), autocast weight copies (split weights)
            f, why = split, f" / {tp} (TP)"
        else:
            out.append(t)
            continue
        out.append(replace(t, nbytes=int(round(t.nbytes * f)), formula=t.formula + why))
    return MemoryEstimate.of(out)


@dataclass(frozen=True)
class TPComm:
    """The TP collectives of one optimizer step on one rank.

    Args:
        seconds: time on the critical path (``None``: the link's bandwidth is unknown).
        nbytes: bytes each rank sends per step.
        link: ``NVLink`` (the TP group fits in a node) or ``network``.
        formula: how it was derived.
    """

    seconds: float | None
    nbytes: float
    link: str
    formula: str


def tp_comm(
    model: Shape,
    micro_batch: int,
    seq_len: int,
    accumulate: int,
    compute_bytes: int,
    tp: int,
    sp: bool,
    devices_per_node: int,
    checkpointed_layers: int,
    nvlink_bytes_per_s: float | None,
    network_bytes_per_s: float | None,
) -> TPComm:
    """Bytes and seconds of the TP all-reduces (or all-gather / reduce-scatter pairs under SP) of one step.

    Raises:
        ConfigError: ``tp`` below 1.
    """
    if tp < 1:
        raise ConfigError("strategy.tensor_parallel_size", tp, "use a positive whole number, e.g. 2, 4 or 8.")
    inside = tp <= devices_per_node
    link, bw = ("NVLink", nvlink_bytes_per_s) if inside else ("network", network_bytes_per_s)
    if tp == 1:
        return TPComm(0.0, 0.0, link, "")
    m = micro_batch * seq_len * model.d_model * compute_bytes
    # 4 collectives per layer (2 forward, 2 backward), each moving 2(t-1)/t x M (all-reduce) or, under SP, an
    # all-gather and a reduce-scatter of (t-1)/t x M each; a recomputed forward adds 2 more.
    per_layer = 4 * 2 * (tp - 1) / tp * m
    recompute = 2 * 2 * (tp - 1) / tp * m
    nbytes = accumulate * (model.n_layers * per_layer + checkpointed_layers * recompute)
    kind = "all-gather + reduce-scatter pairs" if sp else "all-reduces"
    formula = (
        f"{accumulate} x ({model.n_layers} layers x 4 + {checkpointed_layers} recomputed x 2) {kind} x 2 x "
        f"({tp}-1)/{tp} x {m / 1e6:.4g} MB (b·s·h·{compute_bytes} B)"
    )
    if bw is None:
        key = "nvlink_gb_per_s" if inside else "network_gb_per_s"
        return TPComm(None, nbytes, link, formula + f"; not charged: set hardware.{key}")
    return TPComm(nbytes / bw, nbytes, link, formula + f" / {bw / 1e9:g} GB/s {link}")
