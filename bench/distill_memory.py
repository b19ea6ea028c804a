"""Peak memory of the distillation loss, chunked (``chunked_distillation_loss``) vs whole logits, on CPU or a GPU.

Each variant runs in its own subprocess (``--one VARIANT``), so its peak RSS is its own: the inputs (both models'
hidden states and head weights) are allocated first, then one forward + backward of the loss; the figure is the
growth of the peak RSS (``ru_maxrss``) over the RSS before the loss; with ``--device cuda`` it is the growth of
``torch.cuda.max_memory_allocated`` over the memory allocated before the loss. The whole-logits variant is
``distillation_loss(F.linear(h, W), F.linear(h_t, W_t), y)``, what a plain implementation does: both models' ``N x V``
logits, their fp32 log-softmaxes and the gradient of the student's exist at once.

``python bench/distill_memory.py [--tokens 4096] [--vocab 32000] [--d 512] [--d-teacher 1024] [--chunk 512]
[--device cuda]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def one(variant: str, a: argparse.Namespace) -> dict:
    from lightning_trainopt.transforms.distill_loss import chunked_distillation_loss, distillation_loss

    torch.manual_seed(0)
    dev = torch.device(a.device)
    h = torch.randn(a.tokens, a.d, device=dev, requires_grad=True)
    w = (torch.randn(a.vocab, a.d, device=dev) * 0.02).requires_grad_(True)
    ht, wt = torch.randn(a.tokens, a.d_teacher, device=dev), torch.randn(a.vocab, a.d_teacher, device=dev) * 0.02
    y = torch.randint(0, a.vocab, (a.tokens,), device=dev)
    # Warm-up on a few tokens: the kernels' one-time buffers and thread pools are not the loss's memory.
    n = min(16, a.tokens)
    chunked_distillation_loss(h[:n], w, ht[:n], wt, y[:n], chunk_tokens=n).loss.backward()
    distillation_loss(F.linear(h[:n], w), F.linear(ht[:n], wt), y[:n]).loss.backward()
    h.grad = w.grad = None
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else _rss()
    start = time.perf_counter()
    if variant == "chunked":
        terms = chunked_distillation_loss(h, w, ht, wt, y, alpha=0.5, temperature=2.0, chunk_tokens=a.chunk)
    else:
        with torch.no_grad():
            teacher_logits = F.linear(ht, wt)
        terms = distillation_loss(F.linear(h, w), teacher_logits, y, alpha=0.5, temperature=2.0)
    terms.loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _peak()
    return {"variant": variant, "peak_growth_bytes": peak - before, "seconds": seconds,
            "loss": terms.loss.item(), "grad_norm": float(h.grad.norm() + w.grad.norm())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--d-teacher", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--one", choices=["chunked", "whole"])
    parser.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (peak allocated)")
    a = parser.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a)))
        return
    logits = a.tokens * a.vocab * 4
    print(f"N={a.tokens} tokens, V={a.vocab}, d={a.d}, d_teacher={a.d_teacher}, chunk={a.chunk}; "
          f"one model's fp32 logits: {logits / MiB:.0f} MiB")  # fmt: skip
    what = "peak allocated growth" if a.device == "cuda" else "peak RSS growth"
    print(f"| variant | {what} (MiB) | x one logits tensor | fwd+bwd (s) | loss |\n|---|---:|---:|---:|---:|")
    results = {}
    for variant in ("whole", "chunked"):
        argv = [sys.executable, __file__, "--one", variant, *sys.argv[1:]]
        out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]).stdout
        r = results[variant] = json.loads(out.strip().splitlines()[-1])
        print(f"| {variant} | {r['peak_growth_bytes'] / MiB:.0f} | {r['peak_growth_bytes'] / logits:.2f} | "
              f"{r['seconds']:.2f} | {r['loss']:.6f} |")  # fmt: skip
    print(
        f"chunked / whole peak: {results['chunked']['peak_growth_bytes'] / results['whole']['peak_growth_bytes']:.3f}"
    )


if __name__ == "__main__":
    main()
