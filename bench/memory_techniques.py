"""Measure the memory techniques on the demo model: saved-for-backward bytes, peak memory, step time, optimizer states.

Each activation technique runs in its own subprocess, so its peak RSS is its own. All figures are measured in this run
and printed as ratios to the baseline; nothing is assumed.

    python bench/memory_techniques.py                       # CPU defaults: 6 layers, d=256, seq 512, batch 4
    python bench/memory_techniques.py --loss-steps 300      # + int8 vs fp32 loss curve over 300 steps of real text
    python bench/memory_techniques.py --torchao             # + torchao 8/4-bit AdamW (first step compiles, minutes)
    python bench/memory_techniques.py --json out.json

On CUDA the same script also reports torch.cuda.max_memory_allocated per technique and includes `offload`. The
"saved for backward" column is the bytes kept on the compute device (what offload is judged on); bytes moved to host
memory are shown apart. The int8 gradient error is measured at the initial weights (one batch, against the same pass
without compression), so it does not depend on --steps. Without bitsandbytes (or torchao) their optimizer rows are
skipped with a note. A technique whose subprocess fails is reported with its stderr, and the others still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter, transform_saved_tensors  # noqa: E402
from lightning_trainopt.models.config import GPTConfig  # noqa: E402
from lightning_trainopt.models.gpt import GPT  # noqa: E402
from lightning_trainopt.optim.optimizer_states import optimizer_state_bytes  # noqa: E402
from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing  # noqa: E402
from lightning_trainopt.transforms.compression import Int8Compressor, gradient_relative_error  # noqa: E402
from lightning_trainopt.transforms.offload import CpuOffloader  # noqa: E402

TECHNIQUES = ("none", "checkpoint", "checkpoint_every_2nd", "int8")
MiB = 2**20


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        name="bench",
        vocab_size=256,
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        ffn_hidden=int(args.d_model * 8 / 3) // 8 * 8,
        max_seq_len=args.seq_len,
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _build(cfg: GPTConfig, technique: str, device: torch.device) -> tuple[GPT, Any]:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    transform = None
    if technique == "checkpoint":
        apply_activation_checkpointing(model, CheckpointPolicy())
    elif technique == "checkpoint_every_2nd":
        apply_activation_checkpointing(model, CheckpointPolicy(every_k=2))
    elif technique == "int8":
        transform = Int8Compressor()
    elif technique == "offload":
        transform = CpuOffloader()
    return model, transform


def _step(model: GPT, transform: Any, x: torch.Tensor, counter: SavedTensorsCounter | None = None) -> torch.Tensor:
    if counter is not None:
        counter.start()
    if transform is not None:
        with transform_saved_tensors(transform):
            loss = model.loss(x[:, :-1], x[:, 1:])
    else:
        loss = model.loss(x[:, :-1], x[:, 1:])
    if counter is not None:
        counter.stop()
    loss.backward()
    return loss


def run_one(technique: str, args: argparse.Namespace) -> dict[str, Any]:
    """One technique in this process: bytes saved, peak memory, step time (and gradient error for int8)."""
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _config(args)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen).to(device)
    model, transform = _build(cfg, technique, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rss_before = _rss_bytes()
    out: dict[str, Any] = {"technique": technique}
    counter = SavedTensorsCounter(params=model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(model, transform, x, counter if i == 0 else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    report = counter.report()
    out.update(
        saved_bytes=report.activation_bytes,
        saved_device_bytes=report.device_bytes(device.type),
        step_time_s=sorted(times)[len(times) // 2],
        peak_rss_bytes=_peak_rss_bytes(),
        rss_growth_bytes=_peak_rss_bytes() - rss_before,
    )
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if technique in ("int8", "offload"):
        # After the peak-memory readings (a reference pass without the transform would raise the process peak), on a
        # fresh model at its initial weights, so the figure does not depend on --steps: the gradient error against
        # the same weights and batch without the transform.
        del model, optimizer
        model, transform = _build(cfg, technique, device)
        _step(model, None, x)
        reference = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        _step(model, transform, x)
        out["grad_rel_error"] = gradient_relative_error(reference, [p.grad for p in model.parameters()])
    return out


def _installed(package: str, what: str) -> bool:
    if importlib.util.find_spec(package) is not None:
        return True
    print(f"note: {package} is not installed: {what} skipped (pip install lightning_trainopt[...])", file=sys.stderr)
    return False


def optimizer_states(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One step of each optimizer on the demo model; its state bytes per parameter as measured."""
    from lightning_trainopt.optim import optimizers as o

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _config(args)
    factories: dict[str, Any] = {"adamw": o.adamw}
    if _installed("bitsandbytes", "bitsandbytes optimizer rows"):
        factories.update(
            adamw8bit=o.bnb_adamw8bit,
            adam8bit=o.bnb_adam8bit,
            paged_adamw8bit=o.bnb_paged_adamw8bit,
            lion8bit=o.bnb_lion8bit,
        )
    if args.torchao and _installed("torchao", "torchao optimizer rows"):
        factories.update(adamw8bit_torchao=o.torchao_adamw8bit, adamw4bit_torchao=o.torchao_adamw4bit)
    rows = []
    x = torch.randint(0, cfg.vocab_size, (1, 33), device=device)
    for name, factory in factories.items():
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        optimizer = factory(model.parameters(), lr=1e-4)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        optimizer.step()
        r = optimizer_state_bytes(optimizer)
        rows.append({"optimizer": name, **r.as_dict()})
    return rows


def loss_curve(args: argparse.Namespace) -> dict[str, Any]:
    """``--loss-steps`` steps of the demo (gpt_tiny shape) on stdlib text, fp32 vs int8 activations, same data."""
    from lightning_trainopt.data.corpus import read_text_corpus, stdlib_files

    torch.set_num_threads(args.threads)
    tokens = read_text_corpus(stdlib_files(), max_bytes=4_000_000, key="bench.loss_curve")
    cfg = GPTConfig(
        name="gpt_tiny", vocab_size=256, n_layers=4, d_model=128, n_heads=4, ffn_hidden=352, max_seq_len=128
    )
    seq, batch = 128, 8
    curves: dict[str, list[float]] = {}
    for technique in ("none", "int8"):
        torch.manual_seed(0)
        model = GPT(cfg)
        transform = Int8Compressor() if technique == "int8" else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(args.loss_steps):
            starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
            x = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()]).long()
            loss = _step(model, transform, x)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves[technique] = losses
    b, q = torch.tensor(curves["none"]), torch.tensor(curves["int8"])
    sb, sq = b.unfold(0, 10, 10).mean(1), q.unfold(0, 10, 10).mean(1)
    return {
        "steps": args.loss_steps,
        "first10_loss": float(sb[0]),
        "last10_loss_fp32": float(sb[-1]),
        "last10_loss_int8": float(sq[-1]),
        "max_rel_gap_10step_means": float(((sq - sb).abs() / sb).max()),
    }


def _row(r: dict[str, Any], base: dict[str, Any]) -> str:
    host = r["saved_bytes"] - r["saved_device_bytes"]
    err = f"{r['grad_rel_error']:.4f}" if "grad_rel_error" in r else "-"
    return (
        f"| {r['technique']} | {r['saved_device_bytes'] / MiB:.1f} | "
        f"{r['saved_device_bytes'] / base['saved_device_bytes']:.3f} | {host / MiB:.1f} | "
        f"{r['peak_rss_bytes'] / MiB:.0f} | {r['rss_growth_bytes'] / MiB:.0f} | "
        f"{r['rss_growth_bytes'] / max(base['rss_growth_bytes'], 1):.3f} | {r['step_time_s']:.3f} | "
        f"{r['step_time_s'] / base['step_time_s']:.3f} | {err} |"
    )


def _table(rows: list[dict[str, Any]], base: dict[str, Any]) -> str:
    # The saving is judged on the compute device's bytes: offload moves bytes to host memory, it does not remove
    # them, so a total over both devices would show offload at ~1.0x on a GPU.
    lines = [
        "| technique | saved for backward on the compute device (MiB) | vs none | of it moved to host (MiB) "
        "| peak RSS (MiB) | RSS growth (MiB) | vs none | step (s) | vs none | grad rel. err (initial weights) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines.extend(_row(r, base) for r in rows)
    if "cuda_max_allocated_bytes" in base:
        lines.append("")
        lines.append("| technique | cuda max allocated (MiB) | vs none |")
        lines.append("|---|---|---|")
        for r in rows:
            lines.append(
                f"| {r['technique']} | {r['cuda_max_allocated_bytes'] / MiB:.1f} | "
                f"{r['cuda_max_allocated_bytes'] / base['cuda_max_allocated_bytes']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torchao", action="store_true", help="include torchao AdamW8bit/4bit (compiles its step)")
    parser.add_argument("--loss-steps", type=int, default=0, help="also compare int8 vs fp32 loss over N steps")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--only", choices=(*TECHNIQUES, "offload"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seq_len < 512:
        print(
            "note: bench/RESULTS.md measures at sequence lengths of 512 or more; this shorter run is not comparable",
            file=sys.stderr,
        )

    if args.only is not None:
        print(json.dumps(run_one(args.only, args)))
        return

    techniques = list(TECHNIQUES) + (["offload"] if torch.cuda.is_available() else [])
    passthrough = [
        f"--layers={args.layers}",
        f"--d-model={args.d_model}",
        f"--heads={args.heads}",
        f"--seq-len={args.seq_len}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--threads={args.threads}",
    ]
    rows = []
    failed = []
    for technique in techniques:
        proc = subprocess.run(
            [sys.executable, __file__, *passthrough, "--only", technique], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            # Show why: the child's traceback, not only its exit status.
            print(f"technique {technique} failed (exit {proc.returncode}):\n{proc.stderr}", file=sys.stderr)
            failed.append(technique)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if not rows or rows[0]["technique"] != "none":
        sys.exit("the baseline (none) failed; no ratios can be given")
    base = rows[0]
    cfg = _config(args)
    print(
        f"# memory techniques: {cfg.n_layers} layers, d={cfg.d_model}, seq {args.seq_len}, batch {args.batch}, "
        f"{cfg.n_params() / 1e6:.2f}M params, {'cuda' if torch.cuda.is_available() else 'cpu'}, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print(_table(rows, base))
    if failed:
        print(f"\nfailed (see stderr): {', '.join(failed)}")
    states = optimizer_states(args)
    print("\n| optimizer | state B/param | quantised share | B/param (quantised) | B/param (full) | by dtype |")
    print("|---|---|---|---|---|---|")
    for s in states:
        q = s["quantised_bytes_per_param"]
        f = s["full_bytes_per_param"]
        print(
            f"| {s['optimizer']} | {s['bytes_per_param']:.3f} | {s['quantised_params'] / s['n_params']:.4f} | "
            f"{'-' if q is None else f'{q:.3f}'} | {'-' if f is None else f'{f:.3f}'} | {s['by_dtype']} |"
        )
    result: dict[str, Any] = {"activations": rows, "optimizers": states}
    if args.loss_steps:
        curve = loss_curve(args)
        result["loss_curve"] = curve
        print(
            f"\nint8 vs fp32 loss over {curve['steps']} steps (gpt_tiny, stdlib text, seq 128, batch 8): "
            f"10-step mean loss {curve['first10_loss']:.3f} -> fp32 {curve['last10_loss_fp32']:.3f}, "
            f"int8 {curve['last10_loss_int8']:.3f}; max relative gap of 10-step means "
            f"{curve['max_rel_gap_10step_means']:.4f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
