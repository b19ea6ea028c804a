"""What ``plan(cfg)`` returns, as plain data, and its JSON view (``plan.format=json``).

It sits below both ``config.plan`` (which builds it) and ``planner.report`` (which prints it), so neither imports the
other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_trainopt.metrics.hardware import HardwareSpec
from lightning_trainopt.planner import LOCATIONS, Candidate, PlanEstimate, PlanInputs
from lightning_trainopt.planner.teacher import adapter_teacher_dict

__all__ = ["DEFAULT_HFU", "PlanResult", "estimate_dict", "model_flops_per_token"]

#: ``plan.hfu``'s default (``conf/plan.yaml``).
DEFAULT_HFU = 0.4


def model_flops_per_token(inputs: PlanInputs) -> float:
    """Model FLOPs of forward + backward per token (3 x forward, the numerator of MFU), without recomputation."""
    tokens = inputs.micro_batch * inputs.seq_len
    return inputs.profile.flops(inputs.micro_batch, inputs.seq_len)[0] / tokens


@dataclass(frozen=True)
class PlanResult:
    """What ``plan(cfg)`` returns.

    Args:
        estimate: the planner's answer for the configuration as given.
        hardware: the device planned for.
        choices: config group -> preset name of the given configuration (for the ``train.py`` command).
        command: the ``python train.py ...`` command of the configuration (or of the search winner).
        candidates: with ``plan.search=true``, the fitting configurations ranked best first, one per configuration
            (precision, strategy, activations, optimizer), each at its best micro-batch and accumulation.
        n_enumerated: with ``plan.search=true``, how many estimates were made (configuration x micro-batch).
        textbook: the design articles' 16 B/param accounting of the same model, for comparison.
        top_k: rows of the search ranking to show (``plan.top_k``).
        next_step: when the configuration does not fit, what to do instead (more devices or a sharded strategy
            that fits, else ``plan.search=true``); empty when it fits or the device memory is unknown.
        hfu: the hardware FLOPs utilisation assumed for the FLOPs model (``plan.hfu``): the fraction of the dense
            peak sustained on the FLOPs executed, recomputation included.
        seq_len_default_of: the data preset whose default ``seq_len`` is planned; empty when ``data.seq_len`` was
            set.
        seq_len_note: what to do when that default is far below the model's ``max_seq_len``; else empty.
        parallelism: with ``plan.search=true``, the least parallelism that fits (``search.least_parallelism``), or
            that nothing fits and pipeline parallelism or more nodes would be needed.

    Example::

        result = plan(cfg)
        result.to_dict()["per_device_bytes"]["total"]
    """

    estimate: PlanEstimate
    hardware: HardwareSpec
    choices: dict[str, str]
    command: str
    candidates: list[Candidate] = field(default_factory=list)
    n_enumerated: int = 0
    textbook: dict[str, dict[str, int]] = field(default_factory=dict)
    top_k: int = 10
    next_step: str = ""
    hfu: float = DEFAULT_HFU
    seq_len_default_of: str = ""
    seq_len_note: str = ""
    parallelism: str = ""

    @property
    def winner(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view (``plan.format=json``)."""
        out = estimate_dict(self.estimate)
        out.update(
            {
                "hardware": self.hardware.name,
                "choices": dict(self.choices),
                "command": self.command,
                "next_step": self.next_step or None,
                "seq_len_default": bool(self.seq_len_default_of),
                "seq_len_note": self.seq_len_note or None,
                "textbook_model_state_bytes": self.textbook,
                "model": _model_dict(self.estimate.inputs),
                "parallelism": self.parallelism or None,
            }
        )
        out.update(adapter_teacher_dict(self.estimate.inputs))
        if self.candidates or self.n_enumerated:
            out["search"] = {
                "n_enumerated": self.n_enumerated,
                "n_fit": len(self.candidates),
                "top": [
                    {
                        "choices": c.choices,
                        "micro_batch": c.estimate.inputs.micro_batch,
                        "accumulate": c.estimate.inputs.accumulate,
                        "reason": c.reason,
                        **estimate_dict(c.estimate),
                    }
                    for c in self.candidates[: self.top_k]
                ],
            }
        return out


_STATE_CATEGORIES = ("params", "grads", "optimizer_states")


def _model_dict(inputs: PlanInputs) -> dict[str, Any]:
    """What the plan knows about the model and where it comes from (``analytic``: our transformer's formulas;
    ``measured``: read from the module built on the meta device, activations and FLOPs measured)."""
    m = inputs.profile
    return {
        "name": m.name,
        "source": "measured" if m.measured else "analytic",
        "block_class": m.block_class or None,
        "n_blocks": m.n_blocks,
        "tied_params": m.tied_numel,
        "max_seq_len": m.max_seq_len,
    }


def _step_time(e: PlanEstimate) -> dict[str, Any] | None:
    """Where the predicted step time goes: compute, and the offload and compression the FLOPs model does not see."""
    s = e.speed
    if s.compute_s is None:
        return None
    out: dict[str, Any] = {"compute_s": s.compute_s}
    if s.overhead is not None:
        out.update(s.overhead.to_dict())
    return out


def estimate_dict(e: PlanEstimate) -> dict[str, Any]:
    """JSON-safe view of one estimate (the top level of ``plan.format=json`` and each ``search.top`` row)."""
    mem = e.memory
    model_flops = model_flops_per_token(e.inputs)
    return {
        "n_params": e.inputs.profile.n_params,
        "world_size": e.inputs.world_size,
        "data_parallel_size": e.inputs.data_parallel_size,
        "tensor_parallel": e.inputs.tensor_parallel,
        "sequence_parallel": e.inputs.sequence_parallel and e.inputs.tensor_parallel > 1,
        "replicate": e.inputs.replicate,
        "micro_batch": e.inputs.micro_batch,
        "seq_len": e.inputs.seq_len,
        "per_device_bytes": mem.per_device(),
        "peak_bytes": e.peak_device_bytes,
        "cpu_bytes": mem.bytes(location="cpu"),
        "nvme_bytes": mem.bytes(location="nvme"),
        # Host RAM of one node: the offloaded bytes of its ranks against it (the verdict is part of `fits`).
        "host_bytes_per_node": e.host_bytes_per_node,
        "host_memory_bytes": e.host_memory_bytes,
        "host_fits": e.host_fits,
        "device_fits": e.device_fits,
        # Resident bytes, as metrics.json's memory_breakdown snapshot (just before optimizer.step()) sees them.
        "memory_breakdown": {
            c: {loc: mem.bytes(c, loc, resident_only=True) for loc in LOCATIONS} for c in _STATE_CATEGORIES
        },
        # The same categories' bytes that exist only during backward or inside optimizer.step() (DeepSpeed's fp32
        # gradient partition): counted in peak_bytes, absent from a snapshot.
        "memory_transient": {
            c: {loc: mem.bytes(c, loc) - mem.bytes(c, loc, resident_only=True) for loc in LOCATIONS}
            for c in _STATE_CATEGORIES
        },
        "device_memory_bytes": e.device_memory_bytes,
        "fits": e.fits,
        "headroom_bytes": e.headroom_bytes,
        "margin_bytes": e.margin_bytes,
        "model_flops_per_token": model_flops,
        "train_flops_per_token": e.train_flops_per_token,
        "hfu": e.speed.hfu,
        "mfu": e.speed.mfu(model_flops),
        "tokens_per_sec_per_device": e.speed.tokens_per_sec_per_device,
        "step_time_s": e.speed.step_time_s,
        "step_time": _step_time(e),
        "usd_per_1b_tokens": e.speed.usd_per_1b_tokens,
        "hours_to_target": e.speed.hours_to_target,
        "usd_to_target": e.speed.usd_to_target,
        "speed_source": e.speed.source,
        "speed_measured": e.speed.source.startswith("measured"),
        "adam_path": e.inputs.adam_path,
        # Attention kernel planned (math keeps the T x T scores), the loss after the head, the precision preset's
        # model changes (FP8 layers, fp32-kept modules) and the share of the model FLOPs in FP8 layers.
        "attention": e.inputs.attention,
        "loss": e.inputs.loss.name if e.inputs.loss is not None else "standard",
        "precision_changes": e.inputs.precision.to_dict() if e.inputs.precision is not None else None,
        "fp8_flops_share": e.speed.fp8_flops_share,
        "fp8_peak_tflops": e.speed.fp8_peak_flops / 1e12 if e.speed.fp8_peak_flops else None,
        "terms": [
            {
                "category": t.category,
                "location": t.location,
                "label": t.label,
                "bytes": t.nbytes,
                "formula": t.formula,
                "phase": t.phase,
            }
            for t in mem.terms
        ],
    }
