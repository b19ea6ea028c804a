"""A rank Lightning started leaves through the interpreter's exit: 0 when its job succeeded, non-zero when not."""

from __future__ import annotations

import os
import subprocess
import sys

from lightning_trainopt.launch import cli
from lightning_trainopt.launch.launcher import LAUNCHER_PID_ENV
from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env


def test_train_main_returns_on_a_child_rank_with_the_teardown_registered(monkeypatch):
    calls, registered = [], []
    monkeypatch.setattr(cli, "run_hydra", lambda task, name: calls.append(name))
    monkeypatch.setattr(cli, "die_with_parent", lambda launch: None)
    monkeypatch.setattr(cli.atexit, "register", registered.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    cli.train_main()  # returns: no os._exit, the interpreter's exit follows
    assert calls == ["train"]
    assert registered == [cli.release_before_exit]


def test_a_child_rank_whose_job_is_refused_exits_non_zero(tmp_path):
    env = child_env(REPO_ROOT, LOCAL_RANK="1", WORLD_SIZE="2", **{LAUNCHER_PID_ENV: str(os.getpid())})
    proc = subprocess.run(
        [sys.executable, "train.py", "trainer.max_steps=-3", f"hydra.run.dir={tmp_path}"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: trainer.max_steps" in proc.stderr
