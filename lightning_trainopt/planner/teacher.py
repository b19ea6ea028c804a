"""A distillation teacher as the planner counts it: frozen weights in the compute precision, sharded like the student,
no gradients or optimizer states, no saved activations (it runs under ``no_grad``), and its forward FLOPs.

What lives at the student's peak: the teacher's weights (or their shards), and its last hidden states, which the
chunked KL loss reads chunk by chunk after the student's forward (the teacher's full logits never exist). Its forward
runs before the student's, so the layer it computes and, under FSDP2, the units it gathers are freed by then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_trainopt.metrics.flops import teacher_forward_flops
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner.model_profile import gpt_param_groups
from lightning_trainopt.planner.strategy_layout import StrategyLayout
from lightning_trainopt.planner.terms import MemoryEstimate, Term
from lightning_trainopt.planner.terms import numel_text as _gb

__all__ = ["TeacherPlan", "adapter_teacher_dict", "adapter_teacher_lines", "gpt_teacher_plan", "teacher_terms"]


@dataclass(frozen=True)
class TeacherPlan:
    """The teacher, as plain numbers.

    Args:
        name: for reports (its preset or class).
        numels: elements of each of its parameters (each shared one once).
        forward_flops_per_token: FLOPs of one forward per token at the planned sequence length.
        hidden_size: width of its last hidden state, kept for the chunked KL loss.

    Example::

        TeacherPlan("gpt_350m", numels=(50304 * 1024, ...), forward_flops_per_token=7.2e8, hidden_size=1024)
    """

    name: str
    numels: tuple[int, ...]
    forward_flops_per_token: float
    hidden_size: int

    @property
    def n_params(self) -> int:
        """Parameters of the teacher."""
        return sum(self.numels)


def gpt_teacher_plan(cfg: GPTConfig, seq_len: int) -> TeacherPlan:
    """The :class:`TeacherPlan` of our GPT preset ``cfg`` at ``seq_len`` (FLOPs: ``metrics.flops`` forward)."""
    # As SpeedMonitor counts the teacher's forward (metrics.flops.teacher_forward_flops), so MFU agrees.
    flops = teacher_forward_flops(1, seq_len, config=cfg)
    return TeacherPlan(cfg.name, tuple(n for g in gpt_param_groups(cfg) for n in g), flops / seq_len, cfg.d_model)


def teacher_terms(
    teacher: TeacherPlan,
    compute_bytes: int,
    layout: StrategyLayout,
    world_size: int,
    tokens: int,
    tensor_parallel: int = 1,
) -> MemoryEstimate:
    """The teacher's bytes on one rank.

    Args:
        teacher: the teacher.
        compute_bytes: bytes per element of the compute precision (its weights are cast to it).
        layout: the student's strategy: ZeRO-3 and FSDP2 shard the teacher too, parameter offload moves it to the
            host; DDP and ZeRO-1/2 keep it whole on every rank.
        world_size: ranks the student's states are sharded over.
        tokens: tokens of one micro-batch.
        tensor_parallel: the TP size: the teacher gets the student's TP plan, each tensor split over the group (its
            norm vectors, whole on each TP rank, are counted split too: well under 1% of a model's weights).
    """
    w = (world_size if layout.shards_params else 1) * tensor_parallel
    where = "device" if layout.offload_params == "none" else layout.offload_params
    n = teacher.n_params
    shards = sum(math.ceil(k / w) for k in teacher.numels)
    split = f" / {w}" if w > 1 else ""
    return MemoryEstimate.of(
        [
            Term(
                "params",
                where,
                f"teacher ({teacher.name}): {8 * compute_bytes}-bit frozen weights",
                compute_bytes * shards,
                f"{compute_bytes} B x {_gb(n)}{split}",
            ),
            Term(
                "activations",
                "device",
                "teacher: last hidden states (no_grad; read by the chunked KL)",
                compute_bytes * tokens * teacher.hidden_size,
                f"{compute_bytes} B x {tokens:,} tok x {teacher.hidden_size}",
                phase="backward",
            ),
        ]
    )


def adapter_teacher_dict(inputs: Any) -> dict[str, Any]:
    """The plan's JSON ``adapter`` and ``teacher`` entries (``None`` when there is none)."""
    from lightning_trainopt.planner.adapters import adapter_summary

    t = inputs.teacher
    return {
        "adapter": adapter_summary(inputs.adapter) if inputs.adapter is not None else None,
        "teacher": None
        if t is None
        else {"name": t.name, "n_params": t.n_params, "forward_flops_per_token": t.forward_flops_per_token},
    }


def adapter_teacher_lines(inputs: Any) -> list[str]:
    """The plan screen's lines about an adapter and a teacher (none without them)."""
    lines = []
    a = inputs.adapter
    if a is not None:
        what = "the base frozen in NF4 where targeted" if a.quantized else "the base frozen"
        lines.append(
            f"adapter {a.kind} r {a.r} on {len(a.targeted)} linear layers: {a.n_adapter:,} trainable of "
            f"{a.n_adapter + a.n_base:,} parameters ({what}; an adapter changes what is trained)"
        )
    t = inputs.teacher
    if t is not None:
        lines.append(
            f"teacher {t.name}: {t.n_params:,} frozen parameters, {t.forward_flops_per_token:.3g} forward FLOP/token "
            "added to the step"
        )
    return lines
