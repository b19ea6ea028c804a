"""Which model rewrite composes with which strategy family: one table, read by pre-flight and walked by a test.

Rows are the techniques :func:`~lightning_trainopt.parallel.apply.apply_rewrites` applies (and the head loss, which
runs inside the model's head call); columns are strategy families. A cell is :data:`OK` or a :class:`Refusal` with
the reason and what to use instead. Combinations of more than one technique with a strategy are not pairs and would
stay with their own checks in ``config/validate.py`` (none is refused today: a head loss with ``compile=true`` runs
under FSDP2, since compile leaves the head eager).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ADAPTERS",
    "ADAPTER_TABLE",
    "FAMILIES",
    "OK",
    "TABLE",
    "TECHNIQUES",
    "TECHNIQUE_KEYS",
    "Refusal",
    "adapter_cell",
    "cell",
    "family_of",
    "family_of_layout",
    "refusals_markdown",
]

Technique = Literal["fp8", "keep_fp32", "checkpoint", "offload", "int8", "compile", "chunked_ce"]
Family = Literal["single", "ddp", "zero12", "zero3", "fsdp2", "fsdp1", "tp", "fsdp_tp"]

TECHNIQUES: tuple[Technique, ...] = ("fp8", "keep_fp32", "checkpoint", "offload", "int8", "compile", "chunked_ce")
FAMILIES: tuple[Family, ...] = ("single", "ddp", "zero12", "zero3", "fsdp2", "fsdp1", "tp", "fsdp_tp")

#: The config key that turns each technique on, for refusal messages.
TECHNIQUE_KEYS: dict[Technique, str] = {
    "fp8": "precision",
    "keep_fp32": "precision.keep_fp32",
    "checkpoint": "activations",
    "offload": "activations",
    "int8": "activations",
    "compile": "compile",
    "chunked_ce": "loss",
}


@dataclass(frozen=True)
class Refusal:
    """A refused technique x strategy pair: why it breaks, and what to use instead."""

    reason: str
    fix: str


OK = None

_FSDP1_CONVERT = Refusal(
    "Lightning's FSDPStrategy (FSDP1) needs its own FSDPPrecision plugin, which cannot convert layers to FP8 or keep "
    "modules in fp32.",
    "use +strategy=fsdp (FSDP2 through ModelParallelStrategy), which takes these presets.",
)

#: ``TABLE[technique][family]``: ``OK`` or the refusal. Every family not listed for a technique is ``OK``.
TABLE: dict[Technique, dict[Family, Refusal | None]] = {
    technique: dict.fromkeys(FAMILIES, OK) for technique in TECHNIQUES
}
TABLE["fp8"]["fsdp1"] = _FSDP1_CONVERT
TABLE["keep_fp32"]["fsdp1"] = _FSDP1_CONVERT
# Tensor parallelism (+strategy=tp: TP only; +strategy=fsdp_tp: TP x FSDP2/HSDP) composes with every technique:
# FP8 through torchao's float8 plans (tensorwise recipe; with sequence parallelism they all-gather float8, which gloo
# cannot: config/tp_preflight.py refuses that on CPU only), int8 by compressing each saved DTensor's local shard
# (transforms/compression.py), compile per block (parallel/tp.py settles the embedding's asynchronous collective).


# The adapter dimension (``adapter=lora|qlora``, issue #22): which strategy family trains which adapter. What the
# strategies that take one do differently is in parallel/adapters.py; tests/integration/test_adapter_sharding.py fits
# every OK cell of ddp, zero12, zero3, fsdp2 and tp on 2 gloo ranks; tests/unit/parallel/test_tp.py trains lora under
# fsdp_tp (TP 2 x FSDP2 2, and TP 2 x HSDP 2 replicas) on 4 against a one-process replay.
Adapter = Literal["lora", "qlora"]
ADAPTERS: tuple[Adapter, ...] = ("lora", "qlora")

_FSDP1_ADAPTER = Refusal(
    "FSDP1 (Lightning's FSDPStrategy) flattens each unit's parameters into one tensor, so a unit that mixes the frozen "
    "base and trainable adapters keeps gradient and optimizer memory for the whole flat tensor (or needs "
    "use_orig_params and still reduces the frozen gradients' buffers), and it cannot shard bitsandbytes' 4-bit "
    "weights; on a CPU it does not run at all.",
    "use +strategy=fsdp (FSDP2: per-parameter sharding, only the adapters get gradients and optimizer states).",
)
_ZERO_QLORA = Refusal(
    "DeepSpeed's engine breaks bitsandbytes' 4-bit weights: under ZeRO-1/2 the first forward fails (\"shape '[64, 32]' "
    'is invalid for input of size 4096", measured with deepspeed 0.19.8 and bitsandbytes 0.50.2 on 2 gloo ranks), '
    "and ZeRO-3's zero.Init partitions the packed weights into flat buffers that lose their quantization state.",
    "use +strategy=fsdp with adapter=qlora (FSDP2 shards the 4-bit weights stored as bfloat16: Answer.AI's recipe), "
    "or adapter=lora with ZeRO.",
)
_TP_QLORA = Refusal(
    "a 4-bit weight is packed two values a byte in one flat column, with one scale per block of 64 values, so it "
    "cannot be split into the rows or columns a column- or row-parallel layer holds.",
    "use +strategy=fsdp with adapter=qlora, or adapter=lora with +strategy=tp or +strategy=fsdp_tp.",
)
#: ``ADAPTER_TABLE[adapter][family]``: ``OK`` or the refusal (the adapter dimension of :data:`TABLE`).
ADAPTER_TABLE: dict[Adapter, dict[Family, Refusal | None]] = {
    adapter: dict.fromkeys(FAMILIES, OK) for adapter in ADAPTERS
}
for _adapter in ADAPTERS:
    ADAPTER_TABLE[_adapter]["fsdp1"] = _FSDP1_ADAPTER
ADAPTER_TABLE["qlora"]["zero12"] = _ZERO_QLORA
ADAPTER_TABLE["qlora"]["zero3"] = _ZERO_QLORA
ADAPTER_TABLE["qlora"]["tp"] = _TP_QLORA
ADAPTER_TABLE["qlora"]["fsdp_tp"] = _TP_QLORA


def adapter_cell(adapter: str, family: Family) -> Refusal | None:
    """The adapter table's cell: ``None`` (trains) or the :class:`Refusal`; ``adapter="none"`` is always ``None``."""
    row = ADAPTER_TABLE.get(adapter)  # type: ignore[call-overload]
    return None if row is None else row[family]


def cell(technique: Technique, family: Family) -> Refusal | None:
    """The table's cell: ``None`` (composes) or the :class:`Refusal`."""
    return TABLE[technique][family]


def family_of(
    kind: str,
    zero_stage: int | None = None,
    fsdp_version: int | None = None,
    tensor_parallel: int = 1,
    data_parallel: int = 1,
) -> Family | None:
    """The column of a strategy, ``None`` for a strategy class the table does not know (``other``).

    Args:
        kind: :class:`~lightning_trainopt.parallel.spec.StrategySpec` ``kind``: ``none`` (one device), ``ddp``,
            ``deepspeed``, ``fsdp`` or ``other``.
        zero_stage: DeepSpeed's ZeRO stage.
        fsdp_version: 1 (Lightning's FSDPStrategy) or 2 (``fully_shard``).
        tensor_parallel: the tensor-parallel size (``ParallelDims.tp``); above 1 under FSDP2's strategy class:
            ``tp`` (no data parallelism) or ``fsdp_tp``.
        data_parallel: the data-parallel size (``ParallelDims.dp``).
    """
    if kind == "fsdp" and fsdp_version != 1 and tensor_parallel > 1:
        return "fsdp_tp" if data_parallel > 1 else "tp"
    if kind == "deepspeed":
        return "zero3" if zero_stage == 3 else "zero12"
    if kind == "fsdp":
        return "fsdp1" if fsdp_version == 1 else "fsdp2"
    if kind == "other":
        return None
    return "ddp" if kind == "ddp" else "single"


def family_of_layout(layout: Any, tensor_parallel: int = 1, data_parallel: int = 1) -> Family | None:
    """:func:`family_of` for the planner's :class:`~lightning_trainopt.planner.strategy_layout.StrategyLayout`
    (``kind`` ``single`` is one device; FSDP there is FSDP2), so ``config/`` asks here instead of reading its kind."""
    kind = {"single": "none"}.get(layout.kind, layout.kind)
    return family_of(kind, layout.zero_stage or None, 2, tensor_parallel, data_parallel)


def refusals_markdown() -> str:
    """The tables' refused cells as markdown rows ``| technique + family | reason | fix |`` (the adapters' as
    ``adapter=lora + family``)."""
    rows: list[tuple[str, dict[Family, Refusal | None]]] = list(TABLE.items())
    rows += [(f"adapter={adapter}", row) for adapter, row in ADAPTER_TABLE.items()]
    return "\n".join(
        f"| {technique} + {family} | {refusal.reason} | {refusal.fix} |"
        for technique, row in rows
        for family, refusal in row.items()
        if refusal is not None
    )
