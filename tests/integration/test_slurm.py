"""On a real one-node SLURM (``local_slurm``): a sweep submitted with ``hydra/launcher=slurm``, and a pre-empted job
that checkpoints, is requeued by Lightning, comes back and ends as if it had never stopped.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.compose import REPO_ROOT, SMALL_RUN
from tests.helpers.env import child_env
from tests.helpers.slurm import LocalSlurm

TRAIN = str(REPO_ROOT / "train.py")
ARGS = [*SMALL_RUN, "trainer=ddp_sim", "+strategy=ddp", "trainer.limit_val_batches=1"]

pytestmark = pytest.mark.slow


def _scontrol_jobs(job_id: str) -> list[dict[str, str]]:
    """``scontrol -o show job``'s record of ``job_id``, one dict per job (an array gives one per task)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines() if line.strip()]


def test_a_sweep_submitted_to_slurm_runs_each_job_once_as_two_srun_tasks(local_slurm: LocalSlurm, tmp_path: Path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, TRAIN, "-m", "hydra/launcher=slurm", *ARGS, "trainer.max_steps=3"]
        + ["optimizer.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = (sweep / "sweep_summary.md").read_text()
    assert "2 job(s): 2 ok" in summary
    for job, lr in (("0", "optimizer.lr=0.001"), ("1", "optimizer.lr=0.002")):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert (metrics["status"], metrics["world_size"], metrics["global_step"]) == ("ok", 2, 3)
        assert lr in (sweep / job / ".hydra" / "overrides.yaml").read_text()
    # One SLURM array task per job, each run as 2 srun tasks (global ranks 0 and 1 of 2), none run twice.
    tasks = sorted(p for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(tasks) == 2, tasks
    for task in tasks:
        logs = sorted(p.name for p in task.glob("*_log.out"))
        assert logs == [f"{task.name}_0_log.out", f"{task.name}_1_log.out"]
        for rank, log in enumerate(logs):
            assert (task / log).read_text().count("Starting with JobEnvironment") == 1
            assert f"global_rank={rank}(2)" in (task / log).read_text()
    # submitit returns once each job has written its result; SLURM may still be ending the tasks' processes.
    array = tasks[0].name.split("_")[0]
    deadline = time.monotonic() + 120
    records = _scontrol_jobs(array)
    while any(r["JobState"] in ("RUNNING", "COMPLETING") for r in records) and time.monotonic() < deadline:
        time.sleep(1.0)
        records = _scontrol_jobs(array)
    assert [(r["JobState"], r["NumTasks"], r["Restarts"]) for r in records] == [("COMPLETED", "2", "0")] * 2
    # The submission asked SLURM for trainer.devices tasks per node and for the pre-emption signal Lightning handles.
    script = next((sweep / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script
    assert "#SBATCH --signal=USR1@120" in script


def test_a_preempted_job_checkpoints_is_requeued_and_ends_like_an_uninterrupted_run(
    local_slurm: LocalSlurm, tmp_path: Path
):
    # ResumableCheckpoint (callbacks=model_checkpoint) writes the interrupt checkpoint when SLURM stops the job.
    steps = [a for a in ARGS if a != "callbacks=none"] + ["trainer.max_steps=12", "callbacks=model_checkpoint"]
    hold = ["+callbacks.hold._target_=tests.integration._slurm_stall.HoldUntilTerminated", "+callbacks.hold.step=5"]
    command = shlex.join(["srun", sys.executable, TRAIN, *steps, "ckpt_path=auto", *hold])
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
        f"#SBATCH --output={tmp_path / 'job.out'}\n"
        # scancel --full signals the batch shell too; bash would die of SIGUSR1 and end the job.
        "trap 'echo batch script: SIGUSR1' USR1\n"
        'echo "run ${SLURM_RESTART_COUNT:-0}"\n'
        f"{command}\n"
    )
    submit = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        cwd=tmp_path,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        check=True,
    )
    job = submit.stdout.strip()
    out = tmp_path / "job.out"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        if all(f"holding before step 5 (rank {r})" in text for r in (0, 1)):
            break
        assert local_slurm.job_state(job) in ("PENDING", "RUNNING"), text[-3000:]
        time.sleep(0.5)
    else:
        pytest.fail(f"the job never reached step 5:\n{out.read_text()[-3000:] if out.exists() else ''}")
    subprocess.run(["scancel", "--signal=USR1", "--full", job], check=True)
    # Lightning saves on every rank and requeues the job; SLURM lets it start again only ~2 minutes later.
    state = local_slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout_s=420)
    text = out.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert _scontrol_jobs(job)[0]["Restarts"] == "1"
    assert text.count("run 0\n") == 1
    assert text.count("run 1\n") == 1
    run_dir = tmp_path / "outputs" / "train" / f"runs/slurm_{job}"  # keyed by the job id: the requeued run's too
    # SIGUSR1: Lightning's checkpoint in the signal handler; the requeue's SIGTERM: ResumableCheckpoint's, at the end
    # of the step in flight, newer, and the one ckpt_path=auto resumes from (the handler's is written mid-step, with
    # the batch in flight already counted as consumed by the loader).
    # Once the fit has ended the requeue checkpoint is moved aside, else Lightning would load it for the final
    # validation (it loads the newest hpc_ckpt for any validate under SLURM).
    assert (run_dir / "requeue_checkpoints" / "hpc_ckpt_1.ckpt").is_file()
    assert not list(run_dir.glob("hpc_ckpt_*.ckpt"))
    interrupted = sorted((run_dir / "checkpoints").glob("interrupted-step*.ckpt"))
    assert len(interrupted) == 1, interrupted
    assert text.count("Restoring states from the checkpoint path at") == 1
    assert f"Restoring states from the checkpoint path at {interrupted[0]}" in text
    resumed = json.loads((run_dir / "metrics.json").read_text())
    assert (resumed["status"], resumed["global_step"], resumed["world_size"]) == ("ok", 12, 2)

    reference = tmp_path / "uninterrupted"
    proc = subprocess.run(
        [sys.executable, TRAIN, *steps, f"hydra.run.dir={reference}"],
        cwd=tmp_path,
        env={k: v for k, v in child_env(REPO_ROOT).items() if k != "SLURM_CONF"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    whole = json.loads((reference / "metrics.json").read_text())
    for key in ("train_loss", "val_loss"):
        assert resumed[key] == pytest.approx(whole[key], rel=1e-6), key
