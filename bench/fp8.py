"""bf16 against FP8 (torchao, Transformer Engine where it imports), eager and compiled, alone and under FSDP2.

Each configuration is one ``python train.py`` run (the app's own path: our precision plugins, the strategy, the
callbacks), read back from its metrics.json: tokens/s per device (warm-up excluded, SpeedMonitor), MFU against the
bf16 peak, the allocator's peak memory, and the training loss after the last step. Prints a markdown table and
writes it with the raw figures to ``--out``.

    python bench/fp8.py                     # gpt_1b on one GPU (bench/gpu_checks.sh part 4)
    python bench/fp8.py --tiny              # gpt_tiny on the CPU, FP8 emulated: checks the script, measures nothing

Nothing here is a measured figure until a GPU run prints it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def configurations(te: bool, compile_too: bool) -> list[tuple[str, list[str]]]:
    """``(label, train.py overrides)`` for each precision x compile x strategy."""
    precisions = [("bf16", ["precision=bf16"]), ("fp8", ["precision=fp8"])]
    if te:
        precisions.append(("fp8_te", ["precision=fp8_te"]))
    out = []
    for name, prec in precisions:
        for compiled in (False, True) if compile_too else (False,):
            for fsdp in (False, True):
                label = name + (" +compile" if compiled else "") + (" +fsdp" if fsdp else "")
                args = [*prec, f"compile={str(compiled).lower()}"] + (["+strategy=fsdp"] if fsdp else [])
                out.append((label, args))
    return out


def run(label: str, args: list[str], common: list[str], run_dir: Path, timeout: float) -> dict[str, Any]:
    """One train.py run; its figures, or its status and the last error line."""
    cmd = [sys.executable, "train.py", *common, *args, f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"config": label, "status": f"timeout after {timeout:.0f} s", "wall_s": timeout}
    wall = time.perf_counter() - t0
    metrics_file = run_dir / "metrics.json"
    if proc.returncode != 0 or not metrics_file.exists():
        errors = [line for line in (proc.stderr + proc.stdout).splitlines() if "rror" in line]
        return {"config": label, "status": f"exit {proc.returncode}", "error": (errors or ["?"])[-1], "wall_s": wall}
    m = json.loads(metrics_file.read_text())
    throughput = m.get("throughput") or {}
    memory = m.get("memory_breakdown") or {}
    layers = m.get("precision_layers") or {}
    return {
        "config": label,
        "status": m.get("status"),
        "tokens_per_s": throughput.get("tokens_per_s"),
        "mfu": throughput.get("mfu"),
        "peak_memory_gib": memory["peak_memory_bytes"] / 2**30 if memory.get("peak_memory_bytes") else None,
        "train_loss": m.get("train_loss"),
        "steps": m.get("global_step"),
        "fp8_layers": layers.get("fp8_layers"),
        "wall_s": wall,
    }


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | status | tokens/s per device | MFU (bf16 peak) | peak memory GiB | train loss | steps | FP8 layers "
        "| wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = r["status"] + (f" ({r['error'][:80]})" if r.get("error") else "")
        lines.append(
            f"| {r['config']} | {status} | {_cell(r.get('tokens_per_s'), ',.0f')} | {_cell(r.get('mfu'), '.1%')} "
            f"| {_cell(r.get('peak_memory_gib'), '.2f')} | {_cell(r.get('train_loss'), '.4f')} "
            f"| {_cell(r.get('steps'), 'd')} | {_cell(r.get('fp8_layers'), 'd')} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="gpt_tiny on the CPU (a check of the script)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30; tiny 3)")
    parser.add_argument("--batch-size", type=int, default=None, help="micro-batch (default 8; tiny 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default 2048; tiny 64)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled configurations")
    parser.add_argument("--only", nargs="*", default=None, help="run only these labels, e.g. 'fp8 +fsdp'")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_fp8"))
    a = parser.parse_args(argv)
    steps = a.steps or (3 if a.tiny else 30)
    common = [
        f"trainer.max_steps={steps}",
        f"data.batch_size={a.batch_size or (4 if a.tiny else 8)}",
        f"data.seq_len={a.seq_len or (64 if a.tiny else 2048)}",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "logger=none",
        "scheduler=constant",
        # No checkpoint: writing a 1B model's states would be timed as part of the run's wall time.
        "~callbacks.model_checkpoint",
    ]
    if a.tiny:
        common += ["model=gpt_tiny", "trainer.accelerator=cpu", "trainer.devices=1"]
    else:
        common += ["model=gpt_1b", "trainer=gpu", "trainer.devices=1"]
    te = importlib.util.find_spec("transformer_engine") is not None and not a.tiny
    configs = configurations(te, compile_too=not a.no_compile)
    if a.only:
        configs = [c for c in configs if c[0] in a.only]
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (label, args) in enumerate(configs):
        # gpt_tiny's layers are below torchao's break-even size; convert them anyway (bf16 has no such key).
        extra = ["precision.skip_small=false"] if a.tiny and label.startswith("fp8") else []
        row = run(label, args + extra, common, a.out / f"run{i}", a.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    (a.out / "fp8_table.md").write_text(text + "\n")
    (a.out / "fp8_rows.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
