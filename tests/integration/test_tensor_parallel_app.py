"""``python train.py trainer=ddp_sim +strategy=tp``: tensor parallelism over 2 CPU processes (gloo) through the app."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_trainopt.metrics.flops import transformer_flops
from lightning_trainopt.models import GPT, GPTConfig
from tests.helpers.env import child_env

ROOT = Path(__file__).resolve().parents[2]
PEAK_TFLOPS = 0.5  # an assumed CPU peak, only so that MFU is computed and can be checked


@pytest.mark.slow
def test_tp_over_two_processes_counts_one_replica(tmp_path):
    # callbacks=default (SpeedMonitor, MemoryBreakdown and the others); a peak so that MFU is reported on CPU.
    args = [
        "trainer=ddp_sim",
        "+strategy=tp",
        "model=gpt_tiny",
        "data=synthetic",
        "trainer.max_steps=4",
        "callbacks=default",
        f"+hardware.peak_tflops.fp32={PEAK_TFLOPS}",
    ]
    cmd = [sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(ROOT), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == "tp"
    assert (metrics["world_size"], metrics["data_parallel_size"]) == (2, 1)
    assert metrics["parallel_dims"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert metrics["global_step"] == 4
    # One replica's tokens: the two ranks of the tensor-parallel group read the same micro-batches.
    assert metrics["tokens_seen"] == 4 * metrics["micro_batch_size"] * metrics["seq_len"]
    throughput = metrics["throughput"]
    assert throughput["tokens_per_s_total"] == pytest.approx(throughput["tokens"] / throughput["seconds"], rel=1e-9)
    assert throughput["tokens_per_s"] == pytest.approx(throughput["tokens_per_s_total"] / 2, rel=1e-9)
    assert math.isfinite(metrics["train_loss"])
    assert math.isfinite(metrics["val_loss"])

    # SpeedMonitor counts the model's FLOPs once per replica: the whole model's (not 1/TP of it, not TP times it)
    # for the replica's tokens, spread over its 2 devices.
    cfg = GPTConfig(name="gpt_tiny", vocab_size=256, n_layers=4, d_model=128, n_heads=4, ffn_hidden=352)
    seq = metrics["seq_len"]
    assert throughput["flops_source"] == "analytic transformer formula"
    assert throughput["flops_per_token"] == transformer_flops(cfg, seq, 1).train / seq
    per_device = throughput["tokens_per_s_total"] * throughput["flops_per_token"] / metrics["world_size"] / 1e12
    assert throughput["tflops_per_s"] == pytest.approx(per_device, rel=1e-6)
    assert throughput["mfu"] == pytest.approx(per_device / PEAK_TFLOPS, rel=1e-6)

    # MemoryBreakdown reports rank 0's own bytes: the matrices are split over the 2 ranks, the norm vectors
    # (2 per block and the final one) are whole on each; fp32 weights and gradients, AdamW's 2 moments.
    assert metrics["n_params"] == cfg.n_params()
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    per_rank = (cfg.n_params() - norms) // 2 + norms
    breakdown = metrics["memory_breakdown"]
    assert breakdown["params"] == {"device": 4 * per_rank, "cpu": 0, "nvme": 0}
    assert breakdown["grads"]["device"] == 4 * per_rank
    # AdamW's 2 moments plus its step counters (one fp32 scalar per parameter tensor, on every rank).
    with torch.device("meta"):
        tensors = len(list(GPT(cfg).parameters()))
    assert breakdown["optimizer_states"]["device"] == 8 * per_rank + 4 * tensors
    assert breakdown["activations"] > 0
