"""One run per run folder: a lock file with the holder's pid and host, taken by the launching process only.

Two commands with the same ``hydra.run.dir`` at once would mix their ``train.log``, lose one ``metrics.json`` and
``.hydra`` record, and race for ``last.ckpt``. The launching process (global rank 0) takes
``<run dir>/.trainopt.lock`` before anything is written there; the processes of its own job (Lightning's extra
ranks, ``torchrun``/SLURM ranks > 0) never take it. The lock is an ``flock`` on the file, which the kernel drops when
the holder dies, plus its pid and host in the file: a lock left by a dead process on this host (or by an earlier
run of the same SLURM job, requeued) is taken over with a warning; a lock of another host is refused, since its
process cannot be checked from here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from lightning_trainopt.exceptions import RunDirLockedError

__all__ = ["LOCK_FILE", "RunDirLock", "is_launching_rank"]

LOCK_FILE = ".trainopt.lock"

log = logging.getLogger(__name__)

# Rank variables of launchers that start every rank of a job themselves (Lightning's extra ranks, torchrun, SLURM).
_RANK_VARS = ("LOCAL_RANK", "RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")


def is_launching_rank() -> bool:
    """This process is the job's global rank 0 (or a plain single process): the one that takes the run lock."""
    return all(os.environ.get(var, "0") in ("", "0") for var in _RANK_VARS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def _describe(record: dict[str, Any]) -> str:
    return f"pid {record.get('pid')} on host {record.get('host')} since {record.get('since')}"


class RunDirLock:
    """The lock of one run folder, held from :meth:`acquire` to :meth:`release` (or the holder's death).

    Args:
        run_dir: the run folder (created if missing).

    Example::

        lock = RunDirLock("outputs/run1")
        lock.acquire()  # RunDirLockedError if another live run holds it
        try:
            ...
        finally:
            lock.release()
    """

    _held: dict[str, RunDirLock] = {}  # by path: a process re-entering its own folder (a sweep job) does not refuse

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._depth = 0

    @classmethod
    def for_dir(cls, run_dir: str | os.PathLike[str]) -> RunDirLock:
        """The lock object of ``run_dir`` in this process (the same one while it is held)."""
        key = str(Path(run_dir).resolve())
        return cls._held.get(key) or cls(run_dir)

    @property
    def held(self) -> bool:
        """This process holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (re-entrant in this process).

        Raises:
            RunDirLockedError: a live run holds the folder, naming its pid, host and start time.
        """
        if self._fd is not None:
            self._depth += 1
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # a concurrent take-over changed the file under us: look again
            if self._try_create() or self._try_take_over():
                self._depth = 1
                RunDirLock._held[str(self.run_dir)] = self
                return
        raise RunDirLockedError(str(self.run_dir), "the lock file keeps changing", "retry in a moment.")

    def release(self) -> None:
        """Give the lock up (the file is removed once the outermost :meth:`acquire` is released)."""
        if self._fd is None:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        os.close(self._fd)
        self._fd = None
        RunDirLock._held.pop(str(self.run_dir), None)

    # ----------------------------------------------------------------- internals
    def _write_locked_temp(self) -> tuple[int, str]:
        """A temporary file beside the lock with our record, flock-ed: linked or renamed into place complete."""
        temp = str(self.path.with_name(f"{LOCK_FILE}.{uuid.uuid4().hex[:8]}"))
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._flock(fd)
        os.write(fd, json.dumps(_record()).encode())
        os.fsync(fd)
        return fd, temp

    @staticmethod
    def _flock(fd: int) -> bool:
        """``flock(LOCK_EX | LOCK_NB)``: ``False`` when another process holds it; ``True`` also where the filesystem
        has no flock (the pid check alone then decides)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            return err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        return True

    def _try_create(self) -> bool:
        fd, temp = self._write_locked_temp()
        try:
            os.link(temp, self.path)  # atomic: fails when a lock file exists
        except FileExistsError:
            os.close(fd)
            return False
        finally:
            os.unlink(temp)
        self._fd = fd
        return True

    def _try_take_over(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # released meanwhile: create it
        try:
            record = self._read(fd)
            if not self._flock(fd):
                raise RunDirLockedError(str(self.run_dir), _describe(record), self._fix())
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                return False  # replaced after we opened it
            self._check_stale(record)
            new_fd, temp = self._write_locked_temp()
            os.replace(temp, self.path)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        self._fd = new_fd
        return True

    @staticmethod
    def _read(fd: int) -> dict[str, Any]:
        try:
            record = json.loads(os.read(fd, 4096).decode() or "{}")
        except (ValueError, UnicodeDecodeError):
            return {}
        return record if isinstance(record, dict) else {}

    def _fix(self) -> str:
        return f"wait for it to end, or give this run another hydra.run.dir; if that run has ended, delete {self.path}."

    def _check_stale(self, record: dict[str, Any]) -> None:
        """Refuse a lock whose holder may be alive; warn when taking over a dead one's."""
        pid, host = record.get("pid"), record.get("host")
        same_job = record.get("slurm_job_id") is not None and record.get("slurm_job_id") == os.environ.get(
            "SLURM_JOB_ID"
        )
        if host == socket.gethostname() and isinstance(pid, int):
            if pid != os.getpid() and _alive(pid) and not same_job:
                raise RunDirLockedError(str(self.run_dir), _describe(record), self._fix())
            reason = f"process {pid} is no longer running"
        elif same_job:
            reason = f"it was taken by an earlier run of SLURM job {record['slurm_job_id']} (requeued)"
        elif not record:
            reason = "it is empty or unreadable and no process holds it"
        else:
            raise RunDirLockedError(
                str(self.run_dir),
                _describe(record),
                "it was taken on another host, whose process cannot be checked from here; " + self._fix(),
            )
        log.warning("Taking over the stale run lock %s of %s: %s.", self.path, _describe(record), reason)
