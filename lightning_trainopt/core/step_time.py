"""Where the time of a training step goes, and what to do about it.

A step is split at hook boundaries into phases (seconds summed over a window):

- ``data_wait``: between the end of one batch and the start of the next (the dataloader, plus the loop's bookkeeping);
- ``h2d``: the host-to-device copy of the batch (``strategy.batch_to_device``);
- ``forward`` and ``backward`` (exposed communication of DDP/FSDP lies inside ``backward`` unless measured apart);
- ``optimizer``: gradient clipping hooks, the optimizer step (and ZeRO/CPU offload work) and zero_grad;
- ``comm``: exposed communication when a strategy measures it apart, else absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PHASES", "StepSplit", "Verdict", "step_verdict"]

PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer", "comm")


@dataclass
class StepSplit:
    """Seconds per phase over ``steps`` optimizer steps; ``wall`` is the elapsed time they cover."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall: float = 0.0
    steps: int = 0
    comm_measured: bool = False

    def add(self, phase: str, seconds: float) -> None:
        if phase not in self.seconds:
            raise KeyError(f"unknown phase {phase!r}; use one of {PHASES}")
        self.seconds[phase] += max(0.0, seconds)

    def merge(self, other: StepSplit) -> None:
        for k, v in other.seconds.items():
            self.seconds[k] += v
        self.wall += other.wall
        self.steps += other.steps
        self.comm_measured = self.comm_measured or other.comm_measured

    def fractions(self) -> dict[str, float]:
        """Each phase as a fraction of wall time, plus ``other`` (time in no phase: logging, callbacks, ...)."""
        if self.wall <= 0:
            return {}
        out = {k: v / self.wall for k, v in self.seconds.items() if k != "comm" or self.comm_measured}
        out["other"] = max(0.0, 1.0 - sum(out.values()))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": dict(self.seconds),
            "wall": self.wall,
            "steps": self.steps,
            "comm_measured": self.comm_measured,
        }


@dataclass(frozen=True)
class Verdict:
    """What bounds the step, why, and the concrete remedies."""

    kind: str
    reason: str
    remedies: tuple[str, ...]


def step_verdict(
    split: StepSplit,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int | None = None,
    cpu_count: int | None = None,
    offload: bool = False,
    input_threshold: float = 0.15,
    optimizer_threshold: float = 0.30,
    comm_threshold: float = 0.25,
) -> Verdict:
    """Classify a step as ``input-bound``, ``optimizer/offload-bound``, ``communication-bound`` or ``compute-bound``.

    The first threshold crossed in that order wins: input stalls waste everything else, so they come first.

    Args:
        split: measured phases.
        num_workers, pin_memory, prefetch_factor: the DataLoader's settings, for concrete remedies.
        cpu_count: host CPUs available to this rank.
        offload: optimizer states or parameters are offloaded to CPU/NVMe.
        input_threshold: fraction of wall time in ``data_wait + h2d`` above which the step is input-bound.
        optimizer_threshold: fraction in ``optimizer`` above which it is optimizer/offload-bound.
        comm_threshold: fraction in measured ``comm`` above which it is communication-bound.
    """
    f = split.fractions()
    if not f:
        return Verdict("unknown", "no step was timed", ())
    pct = {k: 100 * v for k, v in f.items()}
    input_share = f.get("data_wait", 0.0) + f.get("h2d", 0.0)
    if input_share > input_threshold:
        remedies: list[str] = []
        workers = num_workers or 0
        target = max(2, min(8, cpu_count or 8))
        if workers < target:
            remedies.append(f"raise data.num_workers from {workers} to {target}")
        if workers > 0 and (prefetch_factor or 2) < 4:
            remedies.append(f"raise data.prefetch_factor from {prefetch_factor or 2} to 4")
        if pin_memory is False:
            remedies.append("set data.pin_memory=true (faster, asynchronous host-to-device copies)")
        if workers > 0:
            remedies.append("set data.persistent_workers=true to keep workers across epochs")
        remedies.append("pre-tokenise and memory-map the dataset so __getitem__ does no work")
        return Verdict(
            "input-bound",
            f"{100 * input_share:.0f}% of wall time waits for data (dataloader {pct.get('data_wait', 0):.0f}%, "
            f"host-to-device {pct.get('h2d', 0):.0f}%)",
            tuple(remedies),
        )
    if f.get("optimizer", 0.0) > optimizer_threshold:
        remedies = (
            [
                "offload fewer states (e.g. optimizer only, not parameters) or use a fused CPU Adam",
                "raise the micro-batch or accumulation so each offloaded step covers more tokens",
            ]
            if offload
            else [
                "use a fused/foreach optimizer (torch.optim.AdamW(fused=True) on CUDA)",
                "raise trainer.accumulate_grad_batches so the step is amortised over more tokens",
            ]
        )
        return Verdict(
            "optimizer/offload-bound", f"{pct['optimizer']:.0f}% of wall time is in the optimizer step", tuple(remedies)
        )
    if split.comm_measured and f.get("comm", 0.0) > comm_threshold:
        return Verdict(
            "communication-bound",
            f"{pct['comm']:.0f}% of wall time is exposed communication",
            (
                "raise trainer.accumulate_grad_batches (fewer all-reduces per token)",
                "use a larger DDP bucket_cap_mb or ZeRO-2 overlap_comm",
                "keep tensor parallelism inside one node",
            ),
        )
    compute = f.get("forward", 0.0) + f.get("backward", 0.0)
    return Verdict(
        "compute-bound",
        f"{100 * compute:.0f}% of wall time is forward+backward",
        (
            "use bf16 mixed precision and fused attention (SDPA flash kernels)",
            "torch.compile the model (compile=true)",
            "raise the micro-batch until memory is ~90% used",
        ),
    )
