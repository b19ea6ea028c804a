"""``python train.py trainer=ddp_sim +strategy=tp``: tensor parallelism over 2 CPU processes (gloo) through the app."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tp_over_two_processes_counts_one_replica(tmp_path):
    args = ["trainer=ddp_sim", "+strategy=tp", "model=gpt_tiny", "data=synthetic", "trainer.max_steps=4"]
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
