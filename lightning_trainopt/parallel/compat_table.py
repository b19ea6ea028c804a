"""Which model rewrite composes with which strategy family: one table, read by pre-flight and walked by a test.

Rows are the techniques :func:`~lightning_trainopt.parallel.apply.apply_rewrites` applies (and the head loss, which
runs inside the model's head call); columns are strategy families. A cell is :data:`OK` or a :class:`Refusal` with
the reason and what to use instead. Combinations of more than one technique with a strategy are not pairs and would
stay with their own checks in ``config/validate.py`` (none is refused today: a head loss with ``compile=true`` runs
under FSDP2, since compile leaves the head eager).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FAMILIES",
    "OK",
    "TABLE",
    "TECHNIQUES",
    "TECHNIQUE_KEYS",
    "Refusal",
    "cell",
    "family_of",
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


def refusals_markdown() -> str:
    """The table's refused cells as markdown rows ``| technique + family | reason | fix |``."""
    return "\n".join(
        f"| {technique} + {family} | {refusal.reason} | {refusal.fix} |"
        for technique, row in TABLE.items()
        for family, refusal in row.items()
        if refusal is not None
    )
