"""Parameters per second an optimizer step on the CPU updates: the figure behind ``hardware.cpu_adam_params_per_s``.

    python bench/cpu_adam_throughput.py                      # DeepSpeed CPU Adam, all cores, 1e8 fp32 parameters
    python bench/cpu_adam_throughput.py --threads 1 --optimizer torch_fused

DeepSpeed's CPU Adam is what ZeRO offload steps with; torch's fused AdamW on CPU tensors is what FSDP2's CPU offload
steps with. The planner's rate is for a whole node, all its ranks stepping at once on shared cores and DRAM: run it
with ``--threads`` = the node's cores (or once per rank, at once, with cores / ranks each, and add the rates up).
The first DeepSpeed run compiles its cpu_adam op (about 35 s on 2 cores).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e8, help="fp32 parameters in one flat tensor")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--optimizer", choices=("deepspeed", "torch_fused"), default="deepspeed")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps after one untimed; the fastest counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.params)
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    if args.optimizer == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt: torch.optim.Optimizer = DeepSpeedCPUAdam([param], lr=1e-3, adamw_mode=True)
    else:
        opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()  # allocates the moments
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    best = min(times)
    print(
        f"{args.optimizer}: {n:.3g} params, {args.threads} thread(s): fastest step {best * 1e3:.1f} ms -> "
        f"{n / best:.3g} params/s (steps: {', '.join(f'{t * 1e3:.0f}' for t in times)} ms)"
    )


if __name__ == "__main__":
    main()
