"""`python train.py -m ...` with 2 processes per job: each job runs exactly once, in its own directory."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tests.helpers.compose import REPO_ROOT

SMALL = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.ffn_hidden=128",
    "data.seq_len=32",
    "data.batch_size=4",
    "data=synthetic",
    "trainer.limit_val_batches=2",
    "scheduler.warmup_steps=2",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
]


@pytest.mark.slow
def test_ddp_x_deepspeed_sweep_runs_each_job_once(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "+strategy=ddp,zero2",
        "precision=fp32,bf16",
        "trainer=ddp_sim",
        "trainer.max_steps=20",
        *SMALL,
        f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]

    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1", "2", "3"], "an extra rank re-ran the sweep"
    seen = set()
    for job in jobs:
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["world_size"] == 2
        assert metrics["global_step"] == 20
        seen.add((metrics["strategy"], metrics["precision"]))
        # A child rank that re-ran the sweep would leave its own .hydra output or more job folders.
        assert not any(job.glob("*/.hydra"))
    assert seen == {("ddp", "fp32"), ("ddp", "bf16"), ("zero2", "fp32"), ("zero2", "bf16")}
    zero_stages = {json.loads((j / "metrics.json").read_text())["zero_stage"] for j in jobs}
    assert zero_stages == {None, 2}

    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert len(rows) == 4
    pairs = {
        (o.split("+strategy=")[1].split()[0], o.split("precision=")[1].split()[0])
        for o in (r["overrides"] for r in rows)
    }
    assert pairs == seen
    assert all("trainer.max_steps=20" in r["overrides"] for r in rows)
    md = (sweep / "sweep_summary.md").read_text()
    assert md.count("| ok |") == 4
