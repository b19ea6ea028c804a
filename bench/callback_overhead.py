"""Overhead of the monitoring callbacks: one-time and per-step cost of each, and of all six together, against none.

The six monitors (GPUMonitor, StepTimer, SpeedMonitor, MemoryBreakdown, CostMonitor, NonFiniteGuard) are timed on
the same model and data in one process, each alone, all six together, and none, in rounds whose order alternates
(forward on even rounds, backward on odd ones) so that a drift of the shared machine hits every arm alike.

Two figures per callback:

- **In-hook time** (the table): every hook the callback overrides, and the functions it patches into the loop
  (StepTimer's marks), is wrapped with a timer that counts only the outermost call. Time in ``setup``,
  ``on_fit_start``, ``on_train_start``, ``on_train_end``, ``teardown`` and the like is **one-time**; time inside a
  training step is attributed to that step. A step whose in-hook time exceeds ``median + max(10 x median, 0.5 ms)`` did
  one-time work (FLOP counting at the first batch, MemoryBreakdown's measured step): its excess over the median is
  one-time, the rest per-step. **Per-step** is the mean over all steps of what remains, logging-window closes
  included, and its share of the median step time of the ``none`` arm (its CPU time on CPU). It is the training
  thread's CPU time in our code (``time.thread_time``), so other jobs preempting this process on a shared machine do
  not inflate it.
  Not in it: work outside our hooks, i.e. the saved-tensor hooks MemoryBreakdown installs for the forward of its one
  measured step (one-time), and on a GPU any wait a hook causes later in the step (the monitors add none:
  ``tests/unit/callbacks/test_no_per_step_sync.py``).
- **End-to-end ratio**: the median step time of each arm's run over that of the ``none`` run of the same round,
  median and spread (min-max) over the rounds. On a 2-core VM shared with other jobs identical runs differ by up
  to +-13%, so this ratio cannot resolve 1%; the in-hook time can.

    python bench/callback_overhead.py                                   # plain LightningModule on CPU, 60 steps
    taskset -c 1 python bench/callback_overhead.py --threads 1 --rounds 5   # as recorded in bench/RESULTS.md
    python bench/callback_overhead.py --device cuda --model 125m --steps 60 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_trainopt.callbacks import (  # noqa: E402
    CostMonitor,
    GPUMonitor,
    MemoryBreakdown,
    NonFiniteGuard,
    SpeedMonitor,
    StepTimer,
)
from lightning_trainopt.models.config import GPTConfig  # noqa: E402
from lightning_trainopt.models.lit_gpt import LitGPT  # noqa: E402

GPT_MODELS = {
    "tiny": GPTConfig(name="gpt_tiny", n_layers=4, d_model=128, n_heads=4, ffn_hidden=352, max_seq_len=512),
    "125m": GPTConfig(
        name="gpt_125m", vocab_size=50304, n_layers=12, d_model=768, n_heads=12, ffn_hidden=2048, max_seq_len=2048
    ),
}
VOCAB = 256


class PlainLM(pl.LightningModule):
    """A plain LightningModule (no GPTConfig): SpeedMonitor counts its FLOPs with torch's flop counter, once."""

    def __init__(self, d_model: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        block = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        logits = self.head(self.blocks(self.emb(x)))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


MONITORS: dict[str, Callable[[], pl.Callback]] = {
    "GPUMonitor": GPUMonitor,
    "StepTimer": StepTimer,
    "SpeedMonitor": SpeedMonitor,
    "MemoryBreakdown": MemoryBreakdown,
    "CostMonitor": lambda: CostMonitor(price_per_device_hour=1.0),
    "NonFiniteGuard": NonFiniteGuard,
}
ALL = "all six"


class _StepClock(pl.Callback):
    """Per-step durations (timestamps at every batch start), and the step that is running for :class:`HookClock`.

    On CPU the timestamps are host clocks (wall and the process's CPU time). On CUDA they are CUDA events recorded on
    the current stream, read after ``fit``, so the harness adds no synchronisation to the loop.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.step: int | None = None  # None: outside a training step
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
        self.step = trainer.global_step
        self._mark(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.steps:
            self._mark(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = None

    def step_seconds(self) -> tuple[list[float], list[float]]:
        """(wall or GPU seconds per step, process CPU seconds per step; empty on CUDA)."""
        if self.events:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])], []
        wall = [b - a for a, b in zip(self.wall, self.wall[1:])]
        return wall, [b - a for a, b in zip(self.cpu, self.cpu[1:])]


# Hooks a monitor may override, and the private functions that run inside the loop on its behalf.
_HOOKS = tuple(n for n in dir(pl.Callback) if n.startswith("on_") or n in ("setup", "teardown"))
_PATCHED = ("_mark", "_grads_ready")


class HookClock:
    """CPU seconds of the training thread inside one callback's hooks: outside any step (one-time) and per step.

    ``time.thread_time``: time this thread runs, so a preemption by other jobs on a shared machine is not counted.
    """

    def __init__(self, steps: _StepClock) -> None:
        self._steps = steps
        self._depth = 0
        self.outside = 0.0
        self.per_step: dict[int, float] = {}

    def wrap(self, cb: pl.Callback) -> pl.Callback:
        for name in (*_HOOKS, *_PATCHED):
            own = any(name in vars(k) for k in type(cb).__mro__ if k not in (pl.Callback, object))
            if own:
                setattr(cb, name, self._timed(getattr(cb, name)))
        return cb

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a mark inside a hook: counted by the hook
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.thread_time() - start
                self._depth -= 1
                step = self._steps.step
                if step is None:
                    self.outside += took
                else:
                    self.per_step[step] = self.per_step.get(step, 0.0) + took

        return timed

    def split(self) -> tuple[float, float, float]:
        """(one-time seconds, mean per-step seconds, median per-step seconds) as the module docstring defines."""
        steps = list(self.per_step.values()) or [0.0]
        med = statistics.median(steps)
        limit = med + max(10 * med, 5e-4)
        one_time = self.outside + sum(t - med for t in steps if t > limit)
        kept = [min(t, med) if t > limit else t for t in steps]
        return one_time, statistics.fmean(kept), med


def make_data(args: argparse.Namespace) -> Any:
    """Random tokens: ``(x,)`` batches for the plain module, ``(x, y)`` next-token pairs for LitGPT."""
    g = torch.Generator().manual_seed(0)
    if args.model == "plain":
        rows = torch.randint(0, VOCAB, ((args.steps + 1) * args.batch_size, args.seq_len), generator=g)
        return DataLoader(TensorDataset(rows), batch_size=args.batch_size)
    vocab = GPT_MODELS[args.model].vocab_size
    rows = torch.randint(0, vocab, ((args.steps + 1) * args.batch_size, args.seq_len + 1), generator=g)
    return DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=args.batch_size)


def make_model(args: argparse.Namespace) -> pl.LightningModule:
    torch.manual_seed(0)
    return PlainLM() if args.model == "plain" else LitGPT(GPT_MODELS[args.model])


def one_run(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """Per-step seconds of the timed steps and, per monitor, its :class:`HookClock` split."""
    clock = _StepClock(args.steps)
    names = list(MONITORS) if arm == ALL else [] if arm == "none" else [arm]
    hooks = {n: HookClock(clock) for n in names}
    monitors = [hooks[n].wrap(MONITORS[n]()) for n in names]
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
        callbacks=[clock, *monitors],
    )
    trainer.fit(make_model(args), make_data(args))
    wall, cpu = clock.step_seconds()
    if len(wall) != args.steps:
        raise RuntimeError(f"timed {len(wall)} steps, expected {args.steps}")
    skip = args.warmup  # the first steps pay allocation and one-time work: the step-time median leaves them out
    return {
        "wall": statistics.median(wall[skip:]),
        "cpu": statistics.median(cpu[skip:]) if cpu else None,
        "hooks": {n: h.split() for n, h in hooks.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["plain", *sorted(GPT_MODELS)], default="plain")
    p.add_argument("--precision", default=None, help="default: 32-true on CPU, bf16-mixed on CUDA")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each run's median step time")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--arms", default="each,all", help="each: every monitor alone; all: the six together")
    p.add_argument("--hook-time", action="store_true", help="accepted for bench/gpu_checks.sh; always on")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0: torch's default)")
    args = p.parse_args()
    args.precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "32-true")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    wanted = args.arms.split(",")
    arms = ["none", *(MONITORS if "each" in wanted else []), *([ALL] if "all" in wanted else [])]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    one_run(args, ALL)  # warm caches, kernels and lazy imports before any arm is timed
    started = time.time()
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            runs[arm].append(one_run(args, arm))
    print(
        f"\ncallback overhead: model={args.model} device={args.device} precision={args.precision} "
        f"batch={args.batch_size}x{args.seq_len} steps={args.steps} rounds={args.rounds} "
        f"threads={torch.get_num_threads()} ({time.time() - started:.0f} s)"
    )
    wall = statistics.median(run["wall"] for run in runs["none"])
    # In-hook time is CPU time of the training thread, so on CPU its share is of the step's CPU time: on a loaded
    # machine the wall step stretches with other jobs' work, which would understate the share.
    base = statistics.median(run["cpu"] for run in runs["none"]) if args.device == "cpu" else wall
    print(
        f"median step time of 'none': {1e3 * wall:.2f} ms wall"
        + (f", {1e3 * base:.2f} ms process CPU (the % below)" if args.device == "cpu" else " (the % below)")
        + " (median of the runs' medians, warm-up steps left out)"
    )
    print(
        "\nIn-hook time (training thread CPU; median over rounds). One-time: fit start/end and one-time work in steps."
    )
    print(f"| {'callback':<16} | {'one-time ms':>11} | {'per-step us':>11} | {'per-step % of a step':>20} |")
    print(f"|{'-' * 18}|{'-' * 13}|{'-' * 13}|{'-' * 22}|")
    source = ALL if ALL in runs else None
    totals = [0.0, 0.0]
    for name in MONITORS:
        arm = source or name
        if arm not in runs:
            continue
        one = statistics.median(run["hooks"][name][0] for run in runs[arm])
        per = statistics.median(run["hooks"][name][1] for run in runs[arm])
        totals[0] += one
        totals[1] += per
        print(f"| {name:<16} | {1e3 * one:>11.2f} | {1e6 * per:>11.1f} | {100 * per / base:>19.3f}% |")
    six = f"| {'six together':<16} | {1e3 * totals[0]:>11.2f} | {1e6 * totals[1]:>11.1f} |"
    print(f"{six} {100 * totals[1] / base:>19.3f}% |")
    print(f"(per callback: measured in the '{source}' arm)" if source else "")
    print("\nEnd-to-end: median step time of the arm / of 'none' in the same round (median [min, max] over rounds)")
    for clock in ("wall", "cpu"):
        if runs["none"][0][clock] is None:
            continue
        for arm in arms[1:]:
            ratios = sorted(a[clock] / b[clock] for a, b in zip(runs[arm], runs["none"]))
            print(f"  {clock:<4} {arm:<16} {statistics.median(ratios):.4f} [{ratios[0]:.4f}, {ratios[-1]:.4f}]")


if __name__ == "__main__":
    main()
