"""A real one-node SLURM cluster (Debian's ``slurm-wlm`` and ``munge``), started and stopped by the tests themselves.

The recipe of ``shared/FINDINGS.md`` ("A real SLURM on one machine"), with every file in one temporary folder: a
``munged`` on its own socket and key, a ``slurmctld`` and a ``slurmd`` reading ``<state>/slurm.conf``. Clients
(``sbatch``, ``srun``, ``squeue``, ``scontrol``, and Lightning's ``scontrol requeue``) find the cluster through
``SLURM_CONF``, which :attr:`LocalSlurm.env` sets; nothing under ``/etc`` is touched. Needs root (the daemons run as
root: ``SlurmUser=root``).

Run by hand: ``python -m tests.helpers.slurm DIR`` starts one and prints the ``export SLURM_CONF=...`` line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["LocalSlurm", "slurm_missing"]

_DAEMONS = ("munged", "slurmctld", "slurmd")


def slurm_missing() -> str | None:
    """Why a local SLURM cannot be started here, or ``None`` when it can."""
    missing = [d for d in (*_DAEMONS, "sbatch", "srun", "squeue", "scontrol") if shutil.which(d) is None]
    if missing:
        names = ", ".join(missing)
        return f"slurm-wlm and munge are not installed ({names} not found; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the local SLURM runs its daemons as root"
    return None


class LocalSlurm:
    """One node, one partition ``debug``, started in ``state_dir`` by :meth:`start`, stopped by :meth:`stop`.

    The node declares this machine's CPUs (slurmd refuses a node declared with more), and the partition shares them
    between up to 4 jobs (``OverSubscribe=FORCE:4``), so the jobs of a sweep run side by side as on a real cluster.

    Args:
        state_dir: an empty folder for the key, sockets, configuration, spool, state and logs (mode 0o711: munge
            wants its socket folder unwritable by others).
    """

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.cpus = os.cpu_count() or 1
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.sock"
        self._procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """What a client needs (merged into ``os.environ`` by :meth:`start`)."""
        return {"SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        for sub in ("munge", "spool", "state", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o711)
        (self.dir / "munge").chmod(0o711)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        d = self.dir
        lines = [
            "ClusterName=trainopt_test",
            f"SlurmctldHost={self.host}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            # Ports of their own, so that a cluster another process started on this machine cannot answer.
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobRequeue=1",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "KillWait=30",
            "InactiveLimit=0",
            "MinJobAge=600",
            f"NodeName={self.host} CPUs={self.cpus} RealMemory=20000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 60.0) -> None:
        """Start munged, slurmctld and slurmd; return once the node accepts jobs.

        Raises:
            RuntimeError: a daemon did not start, or the node did not become idle within ``timeout_s`` (its log
                tail is in the message).
        """
        self._write_conf()
        m = self.dir / "munge"
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={m / 'munge.key'}",
                f"--log-file={m / 'munged.log'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
        )
        env = {**os.environ, **self.env}
        for daemon in ("slurmctld", "slurmd"):
            # -D: in the foreground, as our child, so that stop() ends exactly these processes.
            self._procs.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", str(self.conf)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=(self.dir / "log" / f"{daemon}.stderr").open("w"),
                    start_new_session=True,
                )
            )
        os.environ.update(self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self._procs):
                break
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True, check=False
            ).stdout.strip()
            if out in ("idle", "mix", "alloc"):
                return
            if out in ("drain", "inval", "down"):
                break
            time.sleep(0.5)
        logs = "\n".join(p.read_text()[-1500:] for p in sorted((self.dir / "log").iterdir()) if p.is_file())
        self.stop()
        raise RuntimeError(f"the local SLURM did not start:\n{logs}")

    def stop(self) -> None:
        """Cancel every job and wait for them to go, then stop the daemons this object started and munged.

        Jobs are waited for (up to 60 s) first: a job step whose slurmd is gone leaves its ``slurmstepd`` and
        ``srun`` behind for good.
        """
        env = {**os.environ, **self.env}
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, check=False).stdout
            if not left.strip():
                break
            time.sleep(1.0)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        pid_file = self.dir / "munge" / "munged.pid"
        if pid_file.is_file():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        if os.environ.get("SLURM_CONF") == str(self.conf):
            del os.environ["SLURM_CONF"]

    def job_state(self, job_id: str) -> str:
        """``scontrol show job``'s JobState of ``job_id`` (``PENDING``, ``RUNNING``, ``COMPLETED``, ...)."""
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=False
        ).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "UNKNOWN")

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> str:
        """Poll ``job_id`` until its state is one of ``states``; return it (the last state seen at the timeout)."""
        deadline = time.monotonic() + timeout_s
        state = self.job_state(job_id)
        while state not in states and time.monotonic() < deadline:
            time.sleep(1.0)
            state = self.job_state(job_id)
        return state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    cluster = LocalSlurm(Path(sys.argv[1]))
    cluster.start()
    print(f"export SLURM_CONF={cluster.conf}")
    pids = " ".join(str(p.pid) for p in cluster._procs)
    print(f"# stop: kill {pids}; kill $(cat {cluster.munge_socket.parent}/munged.pid)")
