"""Who started this process, and what that means for a run: the one place that tells launch modes apart.

Four launch modes, told apart by the environment alone (:func:`detect_launch`), in the order Lightning picks its
cluster environment (TorchElastic first: torchrun can run inside a SLURM job):

* ``single``: ``python train.py ...`` started this process, the job's rank 0. For ``trainer.devices > 1``
  Lightning's subprocess launcher starts the other ranks by re-running the command line.
* ``lightning_child``: a rank that Lightning's launcher started (``LOCAL_RANK`` > 0, without the variables
  torchelastic sets).
* ``torchrun``: ``torchrun`` (torchelastic) started every rank: ``TORCHELASTIC_RUN_ID`` is set, the test of
  Lightning's ``TorchElasticEnvironment.detect``, beside ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
  ``WORLD_SIZE``. Each rank runs ``python train.py ...`` itself and Lightning starts no process.
* ``slurm``: a SLURM job, where Lightning uses its ``SLURMEnvironment`` (``SLURM_NTASKS`` set and a job name other
  than ``bash``/``interactive``, the test of ``SLURMEnvironment.detect``): ``srun`` started every rank as one of
  its tasks (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``), or ``python`` runs in the batch script itself,
  which is right only for a job of one task (:mod:`lightning_trainopt.launch.slurm` checks the allocation).

A process that some launcher started ends with its parent (:func:`die_with_parent`). The module imports nothing
heavy: ``train.py`` calls that first thing, before the seconds its other imports take.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_trainopt.exceptions import ConfigError

__all__ = [
    "LAUNCHER_PID_ENV",
    "Launch",
    "adopt_submitit_local_ranks",
    "check_launch",
    "detect_launch",
    "die_with_parent",
    "external_launch_argv",
    "mark_launcher",
]

#: The pid of the process that starts a job's other ranks, published for them by :func:`mark_launcher`.
LAUNCHER_PID_ENV = "TRAINOPT_LAUNCHER_PID"

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

LaunchMode = Literal["single", "lightning_child", "torchrun", "slurm"]


@dataclass(frozen=True)
class Launch:
    """How this process was started.

    Attributes:
        mode: ``single``, ``lightning_child``, ``torchrun`` or ``slurm`` (see the module docstring).
        rank: the global rank this process will have (``0`` for ``single``).
        local_rank: the rank on this node.
        world_size: every process of the job; ``None`` where Lightning has not decided it yet (``single``).
        local_world_size: the processes per node an external launcher started (torchrun's ``--nproc_per_node``).
        run_id: an id every rank of the job shares (torchrun's rendezvous id; SLURM's job id, with the array task
            after ``_`` in a job array), ``None`` when there is none.
    """

    mode: LaunchMode
    rank: int
    local_rank: int
    world_size: int | None
    local_world_size: int | None
    run_id: str | None

    @property
    def external(self) -> bool:
        """A launcher outside Lightning started every rank; Lightning must start none."""
        return self.mode in ("torchrun", "slurm")


def detect_launch(env: Mapping[str, str] | None = None) -> Launch:
    """The launch mode of this process, from its environment (``os.environ`` by default)."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return Launch(
            mode="torchrun",
            rank=int(env.get("RANK") or 0),
            local_rank=int(env.get("LOCAL_RANK") or 0),
            world_size=int(env["WORLD_SIZE"]) if env.get("WORLD_SIZE") else None,
            local_world_size=int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None,
            run_id=env["TORCHELASTIC_RUN_ID"],
        )
    from lightning_trainopt.launch.slurm import in_slurm_job, slurm_job_id, slurm_tasks

    if in_slurm_job(env):
        tasks, tasks_per_node = slurm_tasks(env)
        return Launch(
            mode="slurm",
            rank=int(env.get("SLURM_PROCID") or 0),
            local_rank=int(env.get("SLURM_LOCALID") or 0),
            world_size=tasks,
            local_world_size=tasks_per_node,
            run_id=slurm_job_id(env),
        )
    local_rank = int(env.get("LOCAL_RANK") or 0)
    if local_rank > 0:
        world = env.get("WORLD_SIZE")
        return Launch("lightning_child", -1, local_rank, int(world) if world else None, None, None)
    return Launch("single", 0, 0, None, None, None)


def mark_launcher() -> None:
    """In a ``single`` process, publish its pid for the ranks Lightning will start (:func:`die_with_parent`)."""
    if detect_launch().mode == "single":
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())


def die_with_parent(launch: Launch) -> None:
    """In a rank some launcher started: be killed (SIGKILL) when the parent dies, and leave now if it already has.

    Without this, a rank whose launcher was SIGKILLed (Lightning's rank 0 during DeepSpeed start-up, a torchrun
    agent) lived on as an orphan, with parent pid 1, waiting in a rendezvous that would never complete. Linux's
    parent-death signal (``prctl(PR_SET_PDEATHSIG)``) covers a parent that dies from now on; a parent that died
    before the call is seen by comparing the parent pid with the launcher's (``TRAINOPT_LAUNCHER_PID``, set by
    Lightning's rank 0 through :func:`mark_launcher`) or, under torchrun, with 1. SIGKILL, not SIGTERM: an orphaned
    rank can be blocked in a collective that no signal handler returns from. Nothing is done for ``single``, and on
    systems other than Linux.
    """
    if launch.mode == "single" or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    expected = os.environ.get(LAUNCHER_PID_ENV) if launch.mode == "lightning_child" else None
    parent = os.getppid()
    if parent == 1 or (expected is not None and parent != int(expected)):
        print(f"error: the launcher of this rank (pid {expected or '?'}) has exited; not starting.", file=sys.stderr)
        sys.exit(1)


def external_launch_argv(argv: list[str], launch: Launch) -> list[str]:
    """``argv`` for a rank an external launcher started: one run directory for all ranks, one ``.hydra`` record.

    Every rank runs the whole command, so each would pick its own ``outputs/.../<time>`` run directory. Without a
    ``hydra.run.dir`` on the command line the ranks share ``outputs/<task>/runs/torchrun_<rendezvous id>``,
    or under SLURM ``outputs/<task>/runs/slurm_<job id>[_<array task>]`` (``<task>``: a ``task_name=`` on the
    command line, else ``train``): keyed by the job, not the time, so
    a requeued job (same job id) comes back to its own checkpoints. Ranks other than 0 write no ``.hydra/`` record
    (rank 0 does).

    Raises:
        ConfigError: a sweep (``-m``) under torchrun or inside a SLURM job.
    """
    if not launch.external:
        return argv
    if any(a in ("-m", "--multirun") for a in argv):
        raise ConfigError(
            "--multirun",
            True,
            f"a sweep under {launch.mode} would run every job on every rank with its own sweep directory; start one "
            f"{launch.mode} job per run, or sweep with python train.py -m (hydra/launcher=slurm submits each job to "
            "SLURM; without it Lightning starts each job's ranks).",
        )
    args = list(argv)
    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in args):
        # The task's name written out, not ${task_name}: the run lock and the record keeper read this path before
        # Hydra resolves anything (they created a literal "outputs/${task_name}" folder).
        task = next((a.split("=", 1)[1] for a in reversed(args) if a.lstrip("+").startswith("task_name=")), "train")
        prefix = "torchrun" if launch.mode == "torchrun" else "slurm"
        args.append(f"hydra.run.dir=outputs/{task}/runs/{prefix}_{launch.run_id}")
    if launch.rank != 0 and not any(a.lstrip("+").startswith("hydra.output_subdir=") for a in args):
        args.append("hydra.output_subdir=null")
    return args


def _devices_per_node(devices: Any, accelerator: str) -> int | None:
    """What ``trainer.devices`` asks for on one node, as Lightning resolves it; ``None`` if it cannot be told."""
    import torch  # here, not at the top: train.py imports this module first thing, before anything heavy

    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if devices == "auto":
        return torch.cuda.device_count() if on_gpu else 1
    if devices == -1:
        return torch.cuda.device_count() if on_gpu else os.cpu_count()
    return devices if isinstance(devices, int) and not isinstance(devices, bool) else None


def check_launch(
    trainer_cfg: Mapping[str, Any], launch: Launch | None = None, env: Mapping[str, str] | None = None
) -> None:
    """Pre-flight: under an external launcher, ``trainer.devices`` and ``trainer.num_nodes`` match what it started.

    Args:
        trainer_cfg: the ``trainer`` node of the config.
        launch: the launch mode (default: :func:`detect_launch` of ``env``).
        env: the environment (default: ``os.environ``), read for a SLURM job's allocation.

    Raises:
        ConfigError: ``trainer.devices`` differs from torchrun's ``--nproc_per_node``, or ``trainer.num_nodes``
            from its number of nodes; in a SLURM job, an allocation that disagrees with them
            (:func:`lightning_trainopt.launch.slurm.check_slurm`).
    """
    env = os.environ if env is None else env
    launch = detect_launch(env) if launch is None else launch
    if launch.mode == "slurm":
        from lightning_trainopt.launch.slurm import check_slurm

        devices = trainer_cfg.get("devices", "auto")
        per_node = _devices_per_node(devices, str(trainer_cfg.get("accelerator", "auto")))
        check_slurm(env, devices, per_node, trainer_cfg.get("num_nodes", 1))
        return
    if env.get("SUBMITIT_LOCAL_JOB_ID") is not None:
        _check_submitit_local(trainer_cfg, env)
    if not launch.external or launch.local_world_size is None:
        return
    per_node = launch.local_world_size
    devices = trainer_cfg.get("devices", "auto")
    if _devices_per_node(devices, str(trainer_cfg.get("accelerator", "auto"))) != per_node:
        raise ConfigError(
            "trainer.devices",
            devices,
            f"torchrun started {per_node} processes on this node (--nproc_per_node {per_node}); each is one device, "
            f"so set trainer.devices={per_node} (or start torchrun with --nproc_per_node matching trainer.devices).",
        )
    if launch.world_size is not None:
        nodes = launch.world_size // per_node
        num_nodes = trainer_cfg.get("num_nodes", 1)
        if num_nodes != nodes:
            raise ConfigError(
                "trainer.num_nodes",
                num_nodes,
                f"torchrun started {launch.world_size} processes, {per_node} per node: {nodes} node(s); set "
                f"trainer.num_nodes={nodes} (or match torchrun's --nnodes).",
            )


def _check_submitit_local(trainer_cfg: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """A job of ``hydra/launcher=submitit_local`` has one task, one rank, per device of ``trainer.devices``.

    submitit's local executor starts ``hydra.launcher.tasks_per_node`` tasks per job, each running the job
    (:func:`adopt_submitit_local_ranks` makes them the ranks); Lightning cannot start a job's other ranks itself
    there, since it would re-run the command line, which is submitit's runner (``python -m submitit.core._submit``),
    not ``train.py``.
    """
    devices = trainer_cfg.get("devices", "auto")
    per_node = _devices_per_node(devices, str(trainer_cfg.get("accelerator", "auto")))
    tasks = int(env.get("SUBMITIT_LOCAL_NTASKS") or 1)
    if trainer_cfg.get("num_nodes", 1) != 1:
        raise ConfigError(
            "trainer.num_nodes",
            trainer_cfg.get("num_nodes"),
            "hydra/launcher=submitit_local runs each job on this machine alone; use trainer.num_nodes=1, or "
            "hydra/launcher=slurm for several nodes.",
        )
    if per_node != tasks:
        raise ConfigError(
            "trainer.devices",
            devices,
            f"this job of hydra/launcher=submitit_local has {tasks} task(s) (hydra.launcher.tasks_per_node), one "
            f"rank each, and Lightning cannot start more there (it would re-run submitit's runner, not train.py); "
            f"set hydra.launcher.tasks_per_node={per_node or 'N'} to trainer.devices "
            "(hydra.launcher.tasks_per_node='${trainer.devices}').",
        )


def adopt_submitit_local_ranks(env: MutableMapping[str, str] | None = None) -> bool:
    """In a task of a ``hydra/launcher=submitit_local`` job of several tasks, become one rank of the job.

    submitit's local executor starts ``hydra.launcher.tasks_per_node`` processes per job on this machine and tells
    each its place (``SUBMITIT_LOCAL_GLOBALID``, ``SUBMITIT_LOCAL_LOCALID``, ``SUBMITIT_LOCAL_NTASKS``), which
    Lightning does not read. This gives the task the variables torchrun gives its ranks, so Lightning takes its
    ``TorchElasticEnvironment`` (every rank started outside it, none to start) and :func:`detect_launch` the
    ``torchrun`` mode. The rendezvous is ``127.0.0.1`` and a port derived from the job's id (the pid of submitit's
    controller of the job, which all its tasks share and jobs running side by side do not):
    ``10000 + pid % 20000``, below Linux's ephemeral range.

    Returns:
        whether the variables were set (``False`` outside such a job, with one task, or when torchrun's are there).
    """
    env = os.environ if env is None else env
    job = env.get("SUBMITIT_LOCAL_JOB_ID")
    tasks = env.get("SUBMITIT_LOCAL_NTASKS") or "1"
    if job is None or not job.isdigit() or int(tasks) < 2 or env.get("TORCHELASTIC_RUN_ID"):
        return False
    rank = env.get("SUBMITIT_LOCAL_GLOBALID") or "0"
    env.update(
        RANK=rank,
        LOCAL_RANK=env.get("SUBMITIT_LOCAL_LOCALID") or rank,
        GROUP_RANK="0",
        NODE_RANK="0",
        WORLD_SIZE=tasks,
        LOCAL_WORLD_SIZE=tasks,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(10000 + int(job) % 20000),
        TORCHELASTIC_RUN_ID=f"submitit_local_{job}",
    )
    return True
