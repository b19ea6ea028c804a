"""The run-folder lock: one live run per folder, stale locks of dead processes taken over, ranks > 0 never lock."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import textwrap

import pytest

from lightning_trainopt.checkpoint.run_lock import LOCK_FILE, RunDirLock, is_launching_rank
from lightning_trainopt.exceptions import RunDirLockedError

HOLD = textwrap.dedent(
    """
    import sys, time
    from lightning_trainopt.checkpoint.run_lock import RunDirLock
    RunDirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another live process that holds the lock of ``tmp_path / "run"``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_acquire_writes_pid_and_host_and_release_removes_it(tmp_path):
    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert record["host"] == socket.gethostname()
    import os

    assert record["pid"] == os.getpid()
    lock.acquire()  # re-entrant: a sweep job in the folder run_hydra locked
    lock.release()
    assert (tmp_path / "run" / LOCK_FILE).exists()
    lock.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_live_holder_is_refused_with_its_pid(tmp_path, holder):
    with pytest.raises(RunDirLockedError, match=rf"in use by another run \(pid {holder.pid} on host "):
        RunDirLock(tmp_path / "run").acquire()


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, holder, caplog):
    holder.kill()  # SIGKILL: the lock file stays behind
    holder.wait()
    assert (tmp_path / "run" / LOCK_FILE).exists()
    lock = RunDirLock(tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert f"process {holder.pid} is no longer running" in caplog.text
    lock.release()


def test_a_lock_of_another_host_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    record = {"pid": 1, "host": "elsewhere-node", "since": "2026-12-05T03:00:00Z", "slurm_job_id": None}
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(RunDirLockedError, match="elsewhere-node.*another host"):
        RunDirLock(tmp_path / "run").acquire()


def test_a_requeued_slurm_job_takes_its_own_lock_over(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    record = {"pid": 1, "host": "elsewhere-node", "since": "2026-12-05T03:00:00Z", "slurm_job_id": "4242"}
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps(record))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["host"] == socket.gethostname()
    lock.release()


@pytest.mark.parametrize(
    ("env", "launching"),
    [({}, True), ({"LOCAL_RANK": "0"}, True), ({"LOCAL_RANK": "1"}, False), ({"SLURM_PROCID": "3"}, False)],
)
def test_only_rank_zero_locks(monkeypatch, env, launching):
    for var in ("LOCAL_RANK", "RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert is_launching_rank() is launching
