"""Fault injection on real ``python train.py`` runs: a full disk, corrupt checkpoints, a finished run resumed, two
runs in one folder, a nonsense checkpoint argument. Each ends with one ``error:`` line (exit 2) or keeps the results.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_trainopt.checkpoint.run_lock import LOCK_FILE
from lightning_trainopt.checkpoint.verify import checkpoint_problem
from tests.helpers.compose import REPO_ROOT
from tests.helpers.tmpfs import resize_tmpfs, small_tmpfs

# gpt_tiny, a few steps: each checkpoint is about 10 MB (weights + AdamW state), a step about 1 s on 2 cores.
TINY = [
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "data.batch_size=2",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "+callbacks.model_checkpoint.every_n_train_steps=2",
]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *TINY, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained to its end (4 steps, last.ckpt at step 4), started by ``ckpt_path=auto`` in an empty folder."""
    run_dir = tmp_path_factory.mktemp("finished")
    proc = _run("trainer.max_steps=4", f"hydra.run.dir={run_dir}", "ckpt_path=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_finished_run_resumed_keeps_its_results(finished):
    # An automatic retry after pre-emption: the same command again, with ckpt_path=last.
    before = (finished / "metrics.json").read_bytes()
    assert json.loads(before)["train_loss"] is not None
    again = _run("trainer.max_steps=4", f"hydra.run.dir={finished}", "ckpt_path=last")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished training (step 4 of max_steps=4)" in again.stdout + again.stderr
    assert (finished / "metrics.json").read_bytes() == before
    # ckpt_path=auto, the command a pre-emptible job repeats, finds the finished run the same way.
    auto = _run("trainer.max_steps=4", f"hydra.run.dir={finished}", "ckpt_path=auto")
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "has finished training (step 4 of max_steps=4)" in auto.stdout + auto.stderr
    assert (finished / "metrics.json").read_bytes() == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda data: data[: len(data) // 2], "zip archive is truncated or damaged"),
        (lambda data: os.urandom(len(data) // 10), "not a checkpoint (not a torch.save zip archive)"),
    ],
    ids=["truncated", "random-bytes"],
)
def test_a_corrupt_checkpoint_is_one_error_line_naming_it(finished, tmp_path, damage, problem):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(damage((finished / "checkpoints" / "last.ckpt").read_bytes()))
    proc = _run("trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'run'}", f"ckpt_path={bad}")
    line = _one_error_line(proc)
    assert line.startswith(f"error: ckpt_path='{bad}' is invalid: ")
    assert problem in line
    assert not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.slow
def test_every_n_train_steps_minus_one_is_one_error_line(tmp_path):
    args = [a for a in TINY if "every_n_train_steps" not in a]
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            *args,
            "+callbacks.model_checkpoint.every_n_train_steps=-1",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert _one_error_line(proc).startswith("error: callbacks.model_checkpoint.every_n_train_steps=-1 is invalid")


@pytest.mark.slow
def test_a_full_disk_keeps_the_last_good_checkpoint_and_the_run_resumes(tmp_path):
    # 15 MiB: last.ckpt of step 2 (10 MB) fits, the staging file of step 4 beside it does not.
    with small_tmpfs(tmp_path / "disk", "15m") as disk:
        run_dir = disk / "run"
        proc = _run("trainer.max_steps=4", f"hydra.run.dir={run_dir}")
        line = _one_error_line(proc)
        assert "could not write checkpoint" in line
        assert "No space left on device (ENOSPC" in line
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["status"] == "failed"
        assert "ENOSPC" in metrics["error"]
        ckpts = run_dir / "checkpoints"
        assert sorted(os.listdir(ckpts)) == ["last.ckpt"]  # no partial file under any name, hidden or not
        assert checkpoint_problem(ckpts / "last.ckpt") is None
        assert torch.load(ckpts / "last.ckpt", weights_only=False, mmap=True)["global_step"] == 2

        resize_tmpfs(disk, "64m")  # space freed
        resumed = _run("trainer.max_steps=4", f"hydra.run.dir={run_dir}", "ckpt_path=last")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["status"] == "ok"
        assert metrics["global_step"] == 4


@pytest.mark.slow
def test_a_second_run_in_the_same_folder_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path):
    first = subprocess.Popen(
        [sys.executable, "train.py", *TINY, "trainer.max_steps=100000", f"hydra.run.dir={tmp_path}"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "checkpoints" / "last.ckpt").exists():
            assert first.poll() is None, "the first run ended early"
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        hydra_record = sorted(p.name for p in (tmp_path / ".hydra").iterdir())
        second = _run("trainer.max_steps=100000", f"hydra.run.dir={tmp_path}")
        line = _one_error_line(second)
        assert f"is in use by another run (pid {first.pid} on host" in line
        assert sorted(p.name for p in (tmp_path / ".hydra").iterdir()) == hydra_record  # it wrote nothing
        assert first.poll() is None  # and did not disturb the first
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: the lock file stays behind
        first.wait()
    assert (tmp_path / LOCK_FILE).exists()

    step = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, mmap=True)["global_step"]
    resumed = _run(f"trainer.max_steps={step + 2}", f"hydra.run.dir={tmp_path}", "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Taking over the stale run lock {tmp_path / LOCK_FILE} of pid {first.pid}" in (
        resumed.stdout + resumed.stderr
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["status"], metrics["global_step"]) == ("ok", step + 2)
    assert not (tmp_path / LOCK_FILE).exists()
