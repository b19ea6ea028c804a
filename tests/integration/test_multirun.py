"""`python train.py -m ...` with 2 processes per job: each job runs exactly once, in its own directory, and a job
that is refused or fails is recorded without taking the next one down."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.helpers.compose import REPO_ROOT
from tests.helpers.compose import SMALL_RUN as SMALL
from tests.helpers.env import child_env
from tests.helpers.hidden_packages import env_without


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
    # The DeepSpeed jobs report the preset's configured rate, not the first step's (half of it after warmup's first of
    # 2 steps) nor where the cosine ended.
    peak = OmegaConf.load(REPO_ROOT / "lightning_trainopt" / "conf" / "optimizer" / "adamw.yaml").lr
    for job in jobs:
        metrics = json.loads((job / "metrics.json").read_text())
        if metrics["zero_stage"] == 2:
            assert metrics["optimizer"]["lr"] == pytest.approx(peak)
            assert metrics["optimizer"]["lr_now"] < peak

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


def _sweep(cwd, env, *args: str, script: str = "train.py") -> subprocess.CompletedProcess:
    """A sweep run from ``cwd`` (where Hydra's default output folders would appear), as a user runs it."""
    cmd = [sys.executable, str(REPO_ROOT / script), "-m", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def mixed_sweep(tmp_path_factory):
    """4 jobs on 2 processes, torchao not installed: a crash on rank 1 in the fit, a refusal, a good job, a refusal."""
    cwd = tmp_path_factory.mktemp("mixed")
    sweep = cwd / "sweep"
    proc = _sweep(
        cwd,
        env_without(cwd, REPO_ROOT, "torchao"),
        "+callbacks.crash._target_=tests.helpers.crash.CrashAt",
        "+callbacks.crash.step=2,1000",  # 1000: past max_steps, no crash
        "+callbacks.crash.rank=1",
        "optimizer=adamw,adamw8bit_torchao",
        "trainer=ddp_sim",
        "trainer.max_steps=4",
        *SMALL,
        f"hydra.sweep.dir={sweep}",
    )
    metrics = {job.name: json.loads((job / "metrics.json").read_text()) for job in sweep.iterdir() if job.is_dir()}
    return proc, cwd, sweep, metrics


@pytest.mark.slow
def test_a_crashed_job_and_refused_jobs_do_not_take_the_next_job_down(mixed_sweep):
    proc, cwd, sweep, metrics = mixed_sweep
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(metrics) == ["0", "1", "2", "3"]
    assert [metrics[j]["status"] for j in "0123"] == ["failed", "refused", "ok", "refused"]
    good = metrics["2"]
    assert (good["world_size"], good["global_step"]) == (2, 4)
    # The crash on rank 1 is what rank 0's record names, beside rank 0's own lost connection.
    assert "rank 1: RuntimeError: injected crash at step 2 on rank 1" in metrics["0"]["error"]
    # No extra rank re-ran the sweep or started one of its own under Hydra's default output folder.
    assert not (cwd / "outputs").exists()
    assert not any(sweep.glob("*/*/.hydra"))


@pytest.mark.slow
def test_a_missing_optional_package_is_refused_before_any_rank_starts(mixed_sweep):
    _, _, sweep, metrics = mixed_sweep
    for job in ("1", "3"):
        error = metrics[job]["error"]
        assert error.startswith("optimizer=adamw8bit_torchao needs the package 'torchao', which is not installed.")
        assert error.endswith("pip install torch==" + _torch_pin() + ' -e ".[torchao]"')
        log = (sweep / job / "train.log").read_text()
        assert "Initializing distributed" not in log  # no Trainer fit, no rank was started
        assert not list((sweep / job).glob("rank*.error"))


@pytest.mark.slow
def test_the_sweep_summary_lists_every_job_with_its_error(mixed_sweep):
    _, _, sweep, metrics = mixed_sweep
    md = (sweep / "sweep_summary.md").read_text()
    assert "4 job(s): 1 ok, 1 failed, 2 refused;" in md
    errors = md.split("Errors:", 1)[1]
    for job in ("0", "1", "3"):
        assert f"- job {job} ({metrics[job]['status']}): {' '.join(metrics[job]['error'].split())}" in errors
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [r["status"] for r in rows] == ["failed", "refused", "ok", "refused"]


def _torch_pin() -> str:
    import torch

    return torch.__version__.split("+", 1)[0]


@pytest.mark.slow
def test_a_sweep_in_which_every_job_is_refused_exits_2(tmp_path):
    sweep = tmp_path / "sweep"
    env = env_without(tmp_path, REPO_ROOT, "torchao")
    args = ["optimizer=adamw8bit_torchao,adamw4bit_torchao", "trainer=ddp_sim", "trainer.max_steps=4", *SMALL]
    proc = _sweep(tmp_path, env, *args, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "error: no job of the sweep succeeded (job 0 refused, job 1 refused)" in proc.stderr
    md = (sweep / "sweep_summary.md").read_text()
    assert "- job 0 (refused): optimizer=adamw8bit_torchao needs the package 'torchao'" in md
    assert "- job 1 (refused): optimizer=adamw4bit_torchao needs the package 'torchao'" in md


@pytest.mark.slow
def test_a_ladder_rung_on_two_processes_starts_no_sweep_of_its_own(tmp_path):
    # experiment=ladder sets hydra.mode=MULTIRUN in its config; the extra rank must still run its one job, once, and
    # not a sweep of its own in a multiruns/<time>/ folder beside the real one.
    args = ["experiment=ladder", "+experiment/ladder_rung=fp32", "trainer.max_steps=3", "scheduler.warmup_steps=1"]
    args += ["data.seq_len=32", "data.batch_size=2", "model.n_layers=2"]
    proc = _sweep(tmp_path, child_env(REPO_ROOT), *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sweeps = list((tmp_path / "outputs" / "ladder" / "multiruns").iterdir())
    assert len(sweeps) == 1, "an extra rank started a sweep of its own"
    assert json.loads((sweeps[0] / "0" / "metrics.json").read_text())["world_size"] == 2
    assert (proc.stdout + proc.stderr).count("Launching 1 jobs locally") == 1


@pytest.mark.slow
def test_a_plan_sweep_exits_0_and_writes_no_empty_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _sweep(tmp_path, child_env(REPO_ROOT), "trainer.devices=1,2", f"hydra.sweep.dir={sweep}", script="plan.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (sweep / "sweep_summary.md").exists()
