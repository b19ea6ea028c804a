"""``python train.py -m hydra/launcher=submitit_local``: a real two-job sweep through submitit's local executor, each
job 2 tasks (``hydra.launcher.tasks_per_node=2``, ``trainer.devices=2``) that become its 2 ranks, with the sweep
summary, as ``hydra/launcher=slurm`` runs a sweep on a cluster.

One sweep of 2-rank jobs covers what a sweep of 1-rank jobs does (submission, one process per job task, each job's
metrics.json, the summary) and the ranks besides; a 1-rank job takes the same path without
``adopt_submitit_local_ranks`` (tests/unit/launch/test_slurm.py checks both).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.compose import REPO_ROOT, SMALL_RUN
from tests.helpers.env import child_env

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

TRAIN = str(REPO_ROOT / "train.py")

pytestmark = pytest.mark.slow


def test_a_submitit_local_sweep_runs_each_job_once_as_two_ranks_and_writes_the_summary(tmp_path: Path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, TRAIN, "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", *SMALL_RUN]
        + ["trainer=ddp_sim", "+strategy=ddp", "trainer.max_steps=3", "trainer.limit_val_batches=1"]
        + ["optimizer.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"],
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
        assert (metrics["status"], metrics["world_size"], metrics["global_step"]) == ("ok", 2, 3)
        assert lr in (sweep / job / ".hydra" / "overrides.yaml").read_text()
        losses.append(metrics["train_loss"])
    assert losses[0] != losses[1]  # each job trained with its own learning rate
    # Each job ran once, as 2 tasks submitit's local executor started: global ranks 0 and 1 of one process group.
    jobs = sorted(p for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name))
    assert len(jobs) == 2, jobs
    for job_dir in jobs:
        for rank in (0, 1):
            log = (job_dir / f"{job_dir.name}_{rank}_log.out").read_text()
            assert log.count("Starting with JobEnvironment") == 1
            assert f"global_rank={rank}(2)" in log
            err = (job_dir / f"{job_dir.name}_{rank}_log.err").read_text()
            assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in err + log
