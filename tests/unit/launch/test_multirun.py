"""The child ranks of a sweep job run the job once, and a failed job leaves nothing that ends the next one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hydra.types import RunMode
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from omegaconf import open_dict, read_write

from lightning_trainopt.launch import cli, multirun
from tests.helpers.compose import compose_config

_SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_children_get_the_jobs_single_run_command_in_run_mode(tmp_path, monkeypatch):
    from hydra.core.hydra_config import HydraConfig

    cfg = compose_config(["experiment=ladder"], tmp_path)  # the ladder's config sets hydra.mode=MULTIRUN
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.overrides.task = ["experiment=ladder", "+experiment/ladder_rung=fp32"]
        cfg.hydra.overrides.hydra = ["hydra.sweep.dir=/s", "hydra.searchpath=[file:///extra]", "hydra.mode=MULTIRUN"]
    HydraConfig.instance().set_config(cfg)
    monkeypatch.delenv(multirun.CHILD_ARGV_ENV, raising=False)
    multirun.prepare_child_command(tmp_path / "3")
    assert json.loads(os.environ[multirun.CHILD_ARGV_ENV]) == [
        "experiment=ladder",
        "+experiment/ladder_rung=fp32",
        "hydra.sweep.dir=/s",
        "hydra.searchpath=[file:///extra]",
        f"hydra.run.dir={tmp_path / '3'}",
        "hydra.output_subdir=null",
        "hydra.mode=RUN",
    ]


def test_end_job_takes_the_children_from_lightnings_observer_before_stopping_them():
    # The observer SIGKILLs its main process when a child exits non-zero; a stand-in plays the sweep's process.
    sweep_process = subprocess.Popen(_SLEEP)
    child = subprocess.Popen(_SLEEP)
    observer = _ChildProcessObserver(main_pid=sweep_process.pid, child_processes=[child], sleep_period=0.1)
    observer.start()
    try:
        multirun.end_job(timeout_s=0.5)
        assert child.returncode is not None  # a child that did not exit was terminated, and reaped
        observer.join(timeout=5)
        assert not observer.is_alive()
        time.sleep(0.3)
        assert sweep_process.poll() is None, "the observer killed the sweep's process"
    finally:
        for proc in (child, sweep_process):
            proc.kill()
            proc.wait()


def test_a_failed_child_rank_leaves_its_error_and_exits_0_and_rank_0_reports_it(tmp_path, monkeypatch):
    compose_config([], tmp_path)

    def crash(cfg):
        raise RuntimeError("boom on rank 1")

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(multirun.CHILD_ARGV_ENV, "[]")
    monkeypatch.setattr(cli, "_in_multirun", lambda: False)  # a child runs the job as a single run
    with pytest.raises(SystemExit) as exit_:
        cli._guarded(crash)(None)
    assert exit_.value.code == 0
    assert (tmp_path / "rank1.error").read_text() == "RuntimeError: boom on rank 1"

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(cli, "_in_multirun", lambda: True)

    def lost_peer(cfg):
        raise RuntimeError("Connection closed by peer")

    cli._guarded(lost_peer)(None)  # recorded, not raised: the sweep goes on
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics == {
        "status": "failed",
        "error": "RuntimeError: Connection closed by peer; rank 1: RuntimeError: boom on rank 1",
    }


def test_a_failed_sweep_job_restores_the_environment_its_launcher_changed(tmp_path, monkeypatch):
    compose_config([], tmp_path)
    monkeypatch.setattr(cli, "_in_multirun", lambda: True)
    monkeypatch.delenv("MASTER_PORT", raising=False)

    def launched_then_crashed(cfg):
        os.environ["MASTER_PORT"] = "12910"
        os.environ[multirun.CHILD_ARGV_ENV] = "[]"
        raise ValueError("bug")

    cli._guarded(launched_then_crashed)(None)
    assert "MASTER_PORT" not in os.environ
    assert multirun.CHILD_ARGV_ENV not in os.environ
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "failed"
