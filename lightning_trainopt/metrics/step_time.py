"""Where the time of a training step goes, and what to do about it.

A step is split at hook boundaries into phases (seconds summed over a window):

- ``data_wait``: fetching the next batch from the dataloader (marks ``fetch_start``/``fetch_end`` around the loop's
  ``next()`` on its data fetcher), wherever it happens (between steps, or inside ``training_step`` for a module that
  takes ``dataloader_iter``);
- ``h2d``: the host-to-device copy of the batch (``strategy.batch_to_device``);
- ``forward`` and ``backward`` (gradient compute);
- ``optimizer``: gradient clipping hooks, the optimizer step (and ZeRO/CPU offload work) and zero_grad;
- ``comm``: exposed communication, from the moment the last gradient is handed to the gradient reduction
  (mark ``grads_ready``) until backward returns with reduced gradients. Only a strategy with a probe sets that mark
  (today DDP, through a communication hook); elsewhere the wait lies inside the other phases and ``comm`` is absent
  from the fractions.

Everything else in the gap between two steps (checkpoint saving, other callbacks' hooks, logging, the loop's
bookkeeping) belongs to no phase and shows up as ``other``. Where the fetch cannot be timed (``fetch_timed=False``),
the whole gap counts as ``data_wait``, as an upper bound.

Marks are ``(name, seconds)`` pairs taken at hook boundaries; :func:`split_marks` turns them into a
:class:`StepSplit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PHASES", "StepSplit", "Verdict", "split_marks", "step_verdict"]

PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer", "comm")

# (previous mark, next mark) -> phase, fetch marks left out (fetch time is taken out of the span around it);
# pairs not listed count as "other".
_PHASE_OF = {
    ("h2d_start", "h2d_end"): "h2d",
    ("batch_start", "before_backward"): "forward",
    ("before_backward", "after_backward"): "backward",  # no reduction in this backward (no_sync) or no probe
    ("before_backward", "grads_ready"): "backward",
    ("grads_ready", "after_backward"): "comm",
    ("after_backward", "before_optimizer_step"): "optimizer",
    ("before_optimizer_step", "batch_end"): "optimizer",
}
# The gap between two steps outside the fetch: "other", or all of it "data_wait" when the fetch is not timed.
_GAP = {("batch_end", "h2d_start"), ("batch_end", "batch_start"), ("h2d_end", "batch_start")}


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
        """Each phase as a fraction of wall time, plus ``other`` (in no phase: checkpointing, callbacks, logging)."""
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


def split_marks(times: list[tuple[str, float]], comm_measured: bool = False, fetch_timed: bool = True) -> StepSplit:
    """Turn consecutive ``(mark, seconds)`` pairs into a :class:`StepSplit`.

    Wall time is last - first mark, less the time between a ``pause`` and the next mark (validation loops).
    ``fetch_start``/``fetch_end`` pairs are ``data_wait`` and are taken out of the span they fall in, so the rest of
    the gap between two steps (checkpointing, callbacks, logging) stays ``other``.
    A ``grads_ready`` mark inside a backward splits it: before it is gradient compute (``backward``), after it the
    wait for the gradient reduction (``comm``). A backward without one (a ``no_sync`` micro-batch under gradient
    accumulation, which reduces nothing) is all ``backward``.

    Args:
        times: marks in the order they were taken.
        comm_measured: a probe placed ``grads_ready`` marks in this window, so ``comm`` is a measurement (a zero
            means no exposed communication, not "unknown").
        fetch_timed: the dataloader fetch was timed. If not, the whole gap between steps counts as ``data_wait``
            (an upper bound: it then includes checkpointing and callbacks).
    """
    split = StepSplit(comm_measured=comm_measured)
    paused = 0.0
    prev: tuple[str, float] | None = None
    fetch_from: float | None = None
    fetched = 0.0  # fetch seconds inside the span since `prev`
    for name, t in times:
        if name == "fetch_start":
            fetch_from = t
            continue
        if name == "fetch_end":
            if fetch_from is not None:
                split.add("data_wait", t - fetch_from)
                fetched += t - fetch_from
                fetch_from = None
            continue
        if prev is not None:
            a, ta = prev
            phase = _PHASE_OF.get((a, name))
            if phase is None and not fetch_timed and (a, name) in _GAP:
                phase = "data_wait"
            if phase is not None:
                split.add(phase, t - ta - fetched)
            elif a == "pause":
                paused += t - ta
        prev = (name, t)
        fetched = 0.0
    if len(times) > 1:
        split.wall = times[-1][1] - times[0][1] - paused
    split.steps = sum(1 for name, _ in times if name == "before_optimizer_step")
    return split


# Lightning precision strings that compute in 32 or 64 bits: only there is bf16 advice new.
_FULL_PRECISION = frozenset({"32-true", "32", "64-true", "64"})


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
    precision: str | None = None,
    compiled: bool | None = None,
    input_threshold: float = 0.15,
    optimizer_threshold: float = 0.30,
    comm_threshold: float = 0.25,
    other_threshold: float = 0.30,
) -> Verdict:
    """Classify a step as ``input-bound``, ``optimizer/offload-bound``, ``communication-bound``, ``overhead-bound`` or
    ``compute-bound``.

    The first threshold crossed in that order wins: input stalls waste everything else, so they come first.

    Args:
        split: measured phases.
        num_workers, pin_memory, prefetch_factor: the DataLoader's settings, for concrete remedies.
        cpu_count: host CPUs available to this rank.
        offload: optimizer states or parameters are offloaded to CPU/NVMe.
        precision: the run's Lightning precision string (``trainer.precision``, e.g. ``"bf16-mixed"``); a
            compute-bound run already in 16-bit (or lower) precision is not advised to switch to bf16. ``None``:
            unknown, the advice stays.
        compiled: the model is already ``torch.compile``-d; then compiling is not advised. ``None``: unknown.
        input_threshold: fraction of wall time in ``data_wait + h2d`` above which the step is input-bound.
        optimizer_threshold: fraction in ``optimizer`` above which it is optimizer/offload-bound.
        comm_threshold: fraction in measured ``comm`` above which it is communication-bound.
        other_threshold: fraction in ``other`` (time in no phase: checkpoint saving, callbacks, logging between
            steps) above which it is overhead-bound.
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
                "rule out a straggler: waiting in the all-reduce for a slower rank (data, busy host) counts here too",
            ),
        )
    if f.get("other", 0.0) > other_threshold:
        return Verdict(
            "overhead-bound",
            f"{pct['other']:.0f}% of wall time is outside data, copy, compute and optimizer "
            "(checkpoint saving, callbacks, logging between steps)",
            (
                "save checkpoints less often (ModelCheckpoint every_n_train_steps / every_n_epochs)",
                "log less often (raise trainer.log_every_n_steps)",
                "find the slow hook with Lightning's SimpleProfiler (+trainer.profiler=simple lists per-hook time)",
                "raise the micro-batch so the fixed per-step cost is spread over more tokens",
            ),
        )
    compute = f.get("forward", 0.0) + f.get("backward", 0.0)
    remedies = []
    if precision is None or precision in _FULL_PRECISION:
        remedies.append("use bf16 mixed precision (Trainer(precision='bf16-mixed'); train.py: precision=bf16)")
    remedies.append("use fused attention (torch's scaled_dot_product_attention picks flash kernels)")
    if not compiled:
        remedies.append("torch.compile the model (torch.compile(model) on the inner model; train.py: compile=true)")
    remedies.append("raise the micro-batch until memory is ~90% used")
    return Verdict("compute-bound", f"{100 * compute:.0f}% of wall time is forward+backward", tuple(remedies))
