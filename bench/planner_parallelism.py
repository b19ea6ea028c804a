"""The planner's parallelism against the design articles' regimes and published 70B throughput on 64 H100.

    python bench/planner_parallelism.py

Prints two tables (no device needed; everything is the planner's arithmetic):

- the least parallelism that fits, and the search's winner, for gpt_350m, llama_7b, llama_13b and llama_70b on
  8 x H100 SXM per node (bf16 AdamW; DDP, ZeRO-2, ZeRO-3, FSDP2 + TP 1/2/4/8; with and without checkpointing);
- tokens/s/GPU from the planner's FLOPs per token at the published utilisation, beside the published tokens/s/GPU
  (../shared/ANCHORS.md): NeMo Llama 3 70B FP8 (734 model TFLOP/s/GPU, 1,524 tokens/s/GPU, seq 8192) and
  llm-foundry MPT-70B bf16 (42.57% MFU, 1,039 tokens/s/GPU, seq 2048).

``tests/unit/planner/test_parallelism_regimes.py`` asserts the same figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_trainopt.planner import PlanInputs, StrategyLayout, estimate_plan  # noqa: E402
from lightning_trainopt.planner.result import model_flops_per_token  # noqa: E402
from tests.unit.planner.test_parallelism_regimes import H100, MPT_70B, _model, _search  # noqa: E402


def main() -> None:
    """Print the regimes table and the published-figure table (markdown)."""
    print("| model | nodes | least parallelism that fits | search winner (strategy, activations, TP, mb x acc) |")
    print("|---|---|---|---|")
    for name, nodes in (("gpt_350m", 1), ("llama_7b", 1), ("llama_13b", 1), ("llama_70b", 8), ("llama_70b", 1)):
        ranked, needs = _search(name, nodes)
        win = "-"
        if ranked:
            i = ranked[0].estimate.inputs
            ch = ranked[0].choices
            win = f"{ch['strategy']}, {ch['activations']}, TP {i.tensor_parallel}, {i.micro_batch} x {i.accumulate}"
        print(f"| {name} | {nodes} | {needs.message} | {win} |")
    print()
    print("| run | seq | utilisation | planner FLOP/token | planner tok/s/GPU | published tok/s/GPU | diff |")
    print("|---|---|---|---|---|---|---|")
    for label, cfg, seq, dtype, tflops, mfu, published in (
        ("NeMo Llama-3-70B FP8, 64 H100", _model("llama_70b"), 8192, "fp8", 734.0, None, 1524.0),
        ("llm-foundry MPT-70B bf16, 64 H100", MPT_70B, 2048, "bf16", None, 0.4257, 1039.0),
    ):
        inputs = PlanInputs(cfg, "bf16-mixed", StrategyLayout("fsdp", "fsdp"), seq_len=seq, devices=8, num_nodes=8)
        peak = H100.peak(dtype)
        assert peak is not None
        u = tflops * 1e12 / peak if mfu is None else mfu
        tps = estimate_plan(inputs, H100.memory_bytes, peak, None, u).speed.tokens_per_sec_per_device
        assert tps is not None
        print(
            f"| {label} | {seq} | {u:.2%} of {peak / 1e12:g} TFLOP/s {dtype} | {model_flops_per_token(inputs):.4g} | "
            f"{tps:,.1f} | {published:,.0f} | {tps / published - 1:+.2%} |"
        )


if __name__ == "__main__":
    main()
