"""SLURM jobs: what the allocation says, the pre-flight that holds ``trainer`` to it, and who owns requeueing.

Under SLURM every rank is one task that ``srun`` starts (``srun python train.py ...``); Lightning's
``SLURMEnvironment`` reads the ranks from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID`` and the world size from
``SLURM_NTASKS``, and starts no process. Nothing there checks that the allocation is the one the config asks for,
so :func:`check_slurm` refuses, before anything is built:

* ``python train.py`` in the batch script of a job of several tasks: rank 0 would wait for ranks nobody starts;
* ``--gpu-bind=closest``: each task sees only its own GPU as ``cuda:0``, while Lightning puts local rank ``k`` on
  ``cuda:k``;
* ``--ntasks`` without ``--ntasks-per-node`` (which Lightning refuses later, after the imports), tasks per node other
  than ``trainer.devices``, nodes other than ``trainer.num_nodes``, and ``SLURM_NTASKS`` other than devices x nodes
  (``SLURM_NTASKS`` smaller than the tasks per node gives a silently wrong world size: Lightning #20391).

Requeueing has one owner, Lightning's ``SLURMEnvironment(auto_requeue=True)`` (docs/launch.md, "Pre-emption"): on
``SIGUSR1`` every rank writes Lightning's ``hpc_ckpt_<n>.ckpt`` into the run directory and rank 0 runs
``scontrol requeue``. :func:`newest_resume_point` lets ``ckpt_path=auto`` find that checkpoint too, and
:func:`retire_requeue_checkpoints` moves it aside once the fit has ended.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_trainopt.exceptions import ConfigError

__all__ = [
    "REQUEUE_CHECKPOINT_GLOB",
    "check_slurm",
    "gpus_per_node",
    "in_slurm_job",
    "newest_resume_point",
    "register_resolvers",
    "retire_requeue_checkpoints",
    "slurm_job_id",
    "slurm_tasks",
]

#: The checkpoints Lightning's SLURM auto-requeue writes into ``trainer.default_root_dir`` (the run directory).
REQUEUE_CHECKPOINT_GLOB = "hpc_ckpt_*.ckpt"

_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def in_slurm_job(env: Mapping[str, str]) -> bool:
    """Lightning will use its ``SLURMEnvironment`` here (``SLURMEnvironment.detect``): ``SLURM_NTASKS`` is set and
    the job is not an interactive allocation (job name ``bash`` or ``interactive``)."""
    return bool(env.get("SLURM_NTASKS")) and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The job's id, ``<array job>_<array task>`` in a job array (as ``scontrol requeue`` names one array task)."""
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return env.get("SLURM_JOB_ID")


def _in_step(env: Mapping[str, str]) -> bool:
    """This process is a task ``srun`` started (a job step), not the batch script."""
    return bool(env.get("SLURM_STEP_ID"))


def _tasks_on_each_node(spec: str) -> list[int] | None:
    """``SLURM_TASKS_PER_NODE``'s ``2(x3),1`` as ``[2, 2, 2, 1]``; ``None`` if it cannot be read."""
    counts: list[int] = []
    for part in spec.split(","):
        match = _TASKS_PER_NODE.match(part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_tasks(env: Mapping[str, str]) -> tuple[int, int | None]:
    """``(tasks, tasks on this node)`` of what started this process: srun's step, else the job.

    The tasks are Lightning's world size (``SLURM_NTASKS``, which srun sets to the step's tasks); the tasks on this
    node are ``SLURM_NTASKS_PER_NODE`` when the job asked for it, else read from ``SLURM_STEP_TASKS_PER_NODE`` (in a
    step) or ``SLURM_TASKS_PER_NODE`` at this node's index; ``None`` when neither can be read.
    """
    tasks = int(env.get("SLURM_NTASKS") or 1)
    if env.get("SLURM_NTASKS_PER_NODE"):
        return tasks, int(env["SLURM_NTASKS_PER_NODE"])
    spec = env.get("SLURM_STEP_TASKS_PER_NODE" if _in_step(env) else "SLURM_TASKS_PER_NODE")
    counts = _tasks_on_each_node(spec) if spec else None
    node = int(env.get("SLURM_NODEID") or 0)
    return tasks, counts[node] if counts and node < len(counts) else None


def _nodes(env: Mapping[str, str]) -> int:
    key = "SLURM_STEP_NUM_NODES" if _in_step(env) else "SLURM_NNODES"
    return int(env.get(key) or env.get("SLURM_JOB_NUM_NODES") or 1)


def check_slurm(env: Mapping[str, str], devices: Any, devices_per_node: int | None, num_nodes: Any) -> None:
    """Pre-flight of a SLURM job's rank: the allocation is the one ``trainer.devices`` x ``trainer.num_nodes`` asks.

    Args:
        env: the rank's environment.
        devices: ``trainer.devices`` as configured (named in the messages).
        devices_per_node: what it resolves to on one node; ``None`` when it cannot be told (then not compared).
        num_nodes: ``trainer.num_nodes``.

    Raises:
        ConfigError: the key (``trainer.devices``, ``trainer.num_nodes``, ``SLURM_NTASKS``, ``--gpu-bind`` or the
            launch command), the value and the fix; see the module docstring for each case.
    """
    tasks, per_node = slurm_tasks(env)
    nodes = _nodes(env)
    if tasks > 1 and not _in_step(env):
        raise ConfigError(
            "command",
            "python train.py",
            f"this SLURM job has {tasks} tasks (SLURM_NTASKS={tasks}) but train.py runs in its batch script, as one "
            "process: rank 0 would wait for ranks that nothing starts. Start every rank with srun: "
            "srun python train.py ... (or ask for one task per job and let Lightning start the ranks).",
        )
    gpu_bind = env.get("SLURM_GPU_BIND", "")
    if "closest" in gpu_bind:
        raise ConfigError(
            "--gpu-bind",
            gpu_bind,
            "with --gpu-bind=closest each task sees only its own GPU, as cuda:0, while Lightning puts local rank k on "
            "cuda:k (invalid device ordinal, or every rank on one GPU); drop --gpu-bind (or use --gpu-bind=none) and "
            "let each task see the node's GPUs.",
        )
    if tasks > 1 and not env.get("SLURM_NTASKS_PER_NODE"):
        raise ConfigError(
            "--ntasks",
            tasks,
            f"Lightning reads the ranks of a node from --ntasks-per-node, which this job lacks; submit with "
            f"--nodes={num_nodes} --ntasks-per-node={devices_per_node or devices} instead of --ntasks={tasks}.",
        )
    if devices_per_node is not None and per_node is not None and per_node != devices_per_node:
        raise ConfigError(
            "trainer.devices",
            devices,
            f"SLURM started {per_node} task(s) on this node (--ntasks-per-node={per_node}); each is one device, so "
            f"set trainer.devices={per_node} (or submit with --ntasks-per-node={devices_per_node}).",
        )
    if num_nodes != nodes:
        raise ConfigError(
            "trainer.num_nodes",
            num_nodes,
            f"the SLURM job runs on {nodes} node(s); set trainer.num_nodes={nodes} "
            f"(or submit with --nodes={num_nodes}).",
        )
    if devices_per_node is not None and tasks != devices_per_node * nodes:
        raise ConfigError(
            "SLURM_NTASKS",
            tasks,
            f"trainer.devices={devices} x trainer.num_nodes={num_nodes} is {devices_per_node * nodes} ranks but SLURM "
            f"started {tasks} task(s): Lightning would train with a world size of {tasks}. Submit with "
            f"--nodes={nodes} --ntasks-per-node={devices_per_node} and no smaller --ntasks.",
        )


def newest_resume_point(found: str | None, run_dir: Path) -> str | None:
    """``ckpt_path=auto`` under SLURM: the newer of ``found`` and Lightning's newest complete requeue checkpoint.

    Lightning's auto-requeue writes ``hpc_ckpt_<n>.ckpt`` into the run directory, not into ``checkpoints/``;
    ignoring it would resume a requeued job from an older checkpoint and train its last steps twice.

    Args:
        found: the checkpoint ``auto`` found under ``<run_dir>/checkpoints`` (``None``: none).
        run_dir: the run directory.
    """
    from lightning_trainopt.checkpoint.verify import checkpoint_problem

    requeue = sorted(run_dir.glob(REQUEUE_CHECKPOINT_GLOB), key=lambda p: p.stat().st_mtime, reverse=True)
    newest = next((p for p in requeue if checkpoint_problem(p) is None), None)
    if newest is None:
        return found
    if found is None or newest.stat().st_mtime > Path(found).stat().st_mtime:
        return str(newest)
    return found


def gpus_per_node(accelerator: Any, devices: Any) -> int | None:
    """``conf/hydra/launcher/slurm.yaml``'s ``gpus_per_node``: ``trainer.devices`` for a GPU run, else ``None``.

    ``None`` (no ``--gpus-per-node``) for CPU runs and for ``accelerator=auto``, which the submitting machine (often a
    login node without GPUs) cannot decide; a GPU sweep names ``trainer.accelerator=gpu``.
    """
    if str(accelerator) not in ("gpu", "cuda"):
        return None
    return int(devices) if str(devices).lstrip("-").isdigit() and int(devices) > 0 else None


def register_resolvers() -> None:
    """Register ``${trainopt_slurm_gpus:accelerator,devices}`` (:func:`gpus_per_node`) before Hydra composes."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("trainopt_slurm_gpus"):
        OmegaConf.register_new_resolver("trainopt_slurm_gpus", gpus_per_node)


#: Where :func:`retire_requeue_checkpoints` keeps Lightning's requeue checkpoints once the fit has ended.
RETIRED_DIR = "requeue_checkpoints"


def retire_requeue_checkpoints(trainer: Any, run_dir: Path) -> list[Path]:
    """After a SLURM job's fit has ended: move Lightning's ``hpc_ckpt_*.ckpt`` into ``<run_dir>/requeue_checkpoints``.

    Under SLURM Lightning loads the run directory's newest ``hpc_ckpt`` for every ``validate``/``test`` call without a
    ``ckpt_path`` (``_CheckpointConnector._parse_ckpt_path``): the final validation of a requeued job would report
    the weights of the pre-emption, not the final ones. Global rank 0 moves them (kept, out of Lightning's sight);
    every rank waits for it. Does nothing outside a SLURM job; every rank of one takes part.

    Args:
        trainer: the Trainer, right after ``fit``.
        run_dir: the run directory (``trainer.default_root_dir``).

    Returns:
        The checkpoints' new paths (on global rank 0; empty on the others).
    """
    if not in_slurm_job(os.environ):
        return []
    moved: list[Path] = []
    if trainer.is_global_zero:
        found = sorted(run_dir.glob(REQUEUE_CHECKPOINT_GLOB))
        if found:
            (run_dir / RETIRED_DIR).mkdir(exist_ok=True)
        for path in found:
            moved.append(path.rename(run_dir / RETIRED_DIR / path.name))
    trainer.strategy.barrier("retire_requeue_checkpoints")
    return moved
