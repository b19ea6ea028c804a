"""Overhead of the monitoring callbacks: the demo model with all of them on versus none, alternating runs.

Each run trains ``--steps`` optimizer steps and times every step after ``--warmup`` separately (timestamps at each
batch start; CUDA events on a GPU, so the harness adds no synchronisation to the loop). The figure of a run is its
median step time, which the overhead target (at most +1%) is stated in and which a single preempted step cannot move.
Runs alternate (none, all, all, none, ...) in one process so drifts hit both arms; printed are the median over all
timed steps of each arm, the median of the per-round paired ratios and a bootstrap 95% interval for it.

Two clocks on CPU: wall time (what a user pays for) and the process's CPU time (``time.process_time``: every
thread of this process, the monitors' background threads included). On a shared machine, other jobs stretch wall
time by tens of percent while the CPU work of a single-threaded run (``--threads 1``) barely moves, so the CPU-time
ratio resolves a 1% difference where the wall-time ratio cannot.

On the development VM most of the noise is between runs: identical runs settle at speeds up to +-13% apart, pinned
to one core (``taskset -c 1``) or not, so many rounds are needed for a narrow interval (bench/RESULTS.md).

    python bench/callback_overhead.py                           # CPU, gpt_tiny-like model
    taskset -c 1 python bench/callback_overhead.py --threads 1 --rounds 16   # CPU, as recorded in RESULTS.md
    python bench/callback_overhead.py --device cuda --model 125m --steps 60 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_trainopt.callbacks import (  # noqa: E402
    CostMonitor,
    GPUMonitor,
    MemoryBreakdown,
    MemorySnapshot,
    SpeedMonitor,
    StepTimer,
)
from lightning_trainopt.data.datamodule import TextDataModule  # noqa: E402
from lightning_trainopt.models.config import GPTConfig  # noqa: E402
from lightning_trainopt.models.lit_gpt import LitGPT  # noqa: E402

MODELS = {
    "tiny": GPTConfig(name="gpt_tiny", n_layers=4, d_model=128, n_heads=4, ffn_hidden=352, max_seq_len=512),
    "125m": GPTConfig(
        name="gpt_125m", vocab_size=50304, n_layers=12, d_model=768, n_heads=12, ffn_hidden=2048, max_seq_len=2048
    ),
}


class _StepClock(pl.Callback):
    """Per-step durations without adding a synchronisation to the loop.

    A timestamp is taken at the start of every training batch and once more at the end of the last one; the step
    time is the gap between consecutive timestamps, so it covers everything the loop does for that step (data
    loading, every callback hook, forward, backward, optimizer). On CPU the timestamps are host clocks (wall and the
    process's CPU time). On CUDA they are CUDA events recorded on the current stream: they mark the GPU's position in
    its queue, so the gaps are GPU-side step times (a stall of the host that starves the GPU lengthens them) and
    nothing waits on the device until the events are read after ``fit``.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.events: list[Any] = []

    def _mark(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            self._mark(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.steps:
            self._mark(pl_module)

    def step_seconds(self) -> tuple[list[float], list[float]]:
        """(wall or GPU seconds per step, process CPU seconds per step; empty on CUDA)."""
        if self.events:
            torch.cuda.synchronize()
            gpu = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]
            return gpu, []
        wall = [b - a for a, b in zip(self.wall, self.wall[1:])]
        cpu = [b - a for a, b in zip(self.cpu, self.cpu[1:])]
        return wall, cpu


_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
)


class HookClock:
    """Host seconds spent inside the monitors' per-step hooks (wraps the bound methods of each instance)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, callbacks: list[pl.Callback]) -> list[pl.Callback]:
        for cb in callbacks:
            for name in _HOOKS:
                if type(cb).__dict__.get(name) is None:
                    continue
                original = getattr(cb, name)

                def timed(*a: Any, _f: Any = original, **k: Any) -> Any:
                    t = time.perf_counter()
                    try:
                        return _f(*a, **k)
                    finally:
                        self.seconds += time.perf_counter() - t

                setattr(cb, name, timed)
        return callbacks


def monitors(tmp: str) -> list[pl.Callback]:
    """What `callbacks=default` switches on (without checkpointing)."""
    return [
        StepTimer(),
        SpeedMonitor(),
        MemoryBreakdown(),
        CostMonitor(price_per_device_hour=1.0),
        GPUMonitor(),
        MemorySnapshot(dirpath=tmp),
    ]


def one_run(
    args: argparse.Namespace, with_monitors: bool, tmp: str, hooks: HookClock | None = None
) -> dict[str, list[float]]:
    """Per-step seconds of the timed steps: ``{"wall": [...], "cpu": [...]}`` (``wall`` is GPU time on CUDA)."""
    clock = _StepClock(args.warmup, args.steps)
    mons = monitors(tmp) if with_monitors else []
    if hooks is not None:
        hooks.wrap(mons)
    callbacks = [*mons, clock]
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        max_steps=args.steps,
        precision=args.precision,
        log_every_n_steps=args.log_every,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    data = TextDataModule(
        corpus="synthetic",
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        vocab_size=MODELS[args.model].vocab_size,
        synthetic_tokens=4_000_000,
        seed=0,
    )
    trainer.fit(LitGPT(MODELS[args.model]), data)
    wall, cpu = clock.step_seconds()
    if len(wall) != args.steps - args.warmup:
        raise RuntimeError(f"timed {len(wall)} steps, expected {args.steps - args.warmup}")
    return {"wall": wall, "cpu": cpu}


def paired_interval(none: list[float], on: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """Median of the per-round ratios ``on / none`` and a bootstrap 95% interval of that median."""
    ratios = [b / a for a, b in zip(none, on)]
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.median(ratios), meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--precision", default=None, help="default: 32-true on CPU, bf16-mixed on CUDA")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--hook-time", action="store_true", help="also time the monitors' hooks (one extra run per round)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0: torch's default)")
    args = p.parse_args()
    args.precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "32-true")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    arms = ("none", "all monitors")
    clocks = ("wall", "cpu") if args.device == "cpu" else ("wall",)
    # steps[clock][arm] = one list of per-step seconds per run
    steps: dict[str, dict[str, list[list[float]]]] = {c: {arm: [] for arm in arms} for c in clocks}
    hook_s_per_step: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        one_run(args, False, tmp)  # warm caches and kernels before either arm is timed
        for r in range(args.rounds):
            # Alternate which arm goes first, so a drift within a round favours neither.
            for arm in arms if r % 2 == 0 else arms[::-1]:
                per_step = one_run(args, arm != "none", tmp)
                for c in clocks:
                    steps[c][arm].append(per_step[c])
            if args.hook_time:
                hooks = HookClock()
                one_run(args, True, tmp, hooks)
                hook_s_per_step.append(hooks.seconds / args.steps)
    print(
        f"\ncallback overhead: model={args.model} device={args.device} precision={args.precision} "
        f"batch={args.batch_size}x{args.seq_len} steps={args.steps} (timed {args.steps - args.warmup}) "
        f"rounds={args.rounds} threads={torch.get_num_threads()}"
    )
    clock_name = {"wall": "gpu" if args.device == "cuda" else "wall", "cpu": "cpu"}
    print("'median'/'mean': over every timed step of the arm (the mean includes the logging-window closes)")
    header = f"{'clock':<6} {'arm':<14} {'median s':>10} {'ratio':>7} {'mean s':>10} {'ratio':>7}"
    print(f"{header}  per-run medians (s/step)")
    for c in clocks:
        ref_med = statistics.median(x for run in steps[c]["none"] for x in run)
        ref_mean = statistics.fmean(x for run in steps[c]["none"] for x in run)
        for arm in arms:
            med = statistics.median(x for run in steps[c][arm] for x in run)
            mean = statistics.fmean(x for run in steps[c][arm] for x in run)
            runs = ", ".join(f"{statistics.median(run):.4f}" for run in steps[c][arm])
            print(
                f"{clock_name[c]:<6} {arm:<14} {med:>10.5f} {med / ref_med:>7.4f} {mean:>10.5f} {mean / ref_mean:>7.4f}"
                f"  {runs}"
            )
    for c in clocks:
        none = [statistics.median(run) for run in steps[c]["none"]]
        on = [statistics.median(run) for run in steps[c]["all monitors"]]
        med, lo, hi = paired_interval(none, on)
        print(
            f"overhead ({clock_name[c]}): {100 * (med - 1):+.2f}% median of the paired per-run ratios of median step "
            f"times, bootstrap 95% interval [{100 * (lo - 1):+.2f}%, {100 * (hi - 1):+.2f}%] (target <= +1%)"
        )
    if hook_s_per_step:
        h = statistics.median(hook_s_per_step)
        base = statistics.median(x for run in steps["wall"]["none"] for x in run)
        print(
            f"host time inside the monitors' per-step hooks: {1e3 * h:.3f} ms/step = {100 * h / base:.3f}% of the "
            f"median step (all steps, window closes included; less sensitive to machine noise than the ratio)"
        )


if __name__ == "__main__":
    main()
