"""``python train.py -m hydra/launcher=submitit_local``: a real two-job sweep through submitit's local executor, each
job a process of its own (one device each), with the sweep summary, as ``hydra/launcher=slurm`` runs it on a cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.compose import REPO_ROOT, SMALL_RUN
from tests.helpers.env import child_env

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

TRAIN = str(REPO_ROOT / "train.py")

pytestmark = pytest.mark.slow


def test_a_submitit_local_sweep_runs_each_job_once_and_writes_the_summary(tmp_path: Path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, TRAIN, "-m", "hydra/launcher=submitit_local", *SMALL_RUN, "trainer.accelerator=cpu"]
        + ["trainer.devices=1", "trainer.max_steps=3", "trainer.limit_val_batches=1", "optimizer.lr=1e-3,2e-3"]
        + [f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 job(s): 2 ok" in (sweep / "sweep_summary.md").read_text()
    losses = []
    for job, lr in (("0", "optimizer.lr=0.001"), ("1", "optimizer.lr=0.002")):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert (metrics["status"], metrics["world_size"], metrics["global_step"]) == ("ok", 1, 3)
        assert lr in (sweep / job / ".hydra" / "overrides.yaml").read_text()
        losses.append(metrics["train_loss"])
    assert losses[0] != losses[1]  # each job trained with its own learning rate
    # Each job ran once, in a process submitit's local executor started (its log names the job environment).
    logs = sorted((sweep / ".submitit").glob("*/*_0_log.out"))
    assert len(logs) == 2, logs
    for log in logs:
        assert log.read_text().count("Starting with JobEnvironment") == 1
