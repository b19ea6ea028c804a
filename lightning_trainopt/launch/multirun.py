"""Hydra multirun x Lightning's subprocess launcher, done properly.

Lightning starts ranks 1..N-1 of a DDP/DeepSpeed job by re-running the script with ``sys.argv``. Under
``python train.py -m ...`` that argv is the whole sweep, so every extra rank would re-run every job (the known
Lightning/Hydra trap: lightning-hydra-template #393, Lightning PR #18175). Instead, rank 0 of each job leaves
the single-run command of *its* job in the environment that the children inherit, and the children replace
their argv with it before Hydra parses anything: one run, in the job's own directory, with the job's overrides.

A job that fails must not take the sweep with it. Lightning watches the children it started from a thread of the
launching process (``_ChildProcessObserver``, reached through ``_compat.lightning_internals``)
that SIGKILLs the launching process, here the whole sweep, as soon as a child exits with a non-zero code. So a
child rank of a sweep job that fails leaves its error in the job directory (:func:`record_child_error`) and exits
with code 0, and rank 0, once it has failed too, takes the children back from the observer, waits for them and
tears the process group down (:func:`end_job`) before the next job starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from lightning_trainopt._compat.lightning_internals import take_observed_children
from lightning_trainopt._compat.torch_internals import restore_builtin_linear

__all__ = [
    "CHILD_ARGV_ENV",
    "apply_child_command",
    "child_errors",
    "end_job",
    "is_sweep_child",
    "prepare_child_command",
    "record_child_error",
    "restore_env",
    "snapshot_env",
    "teardown_distributed",
]

CHILD_ARGV_ENV = "TRAINOPT_CHILD_ARGV"

# Hydra overrides that the child's own single-run command sets: the job's directory, no second .hydra/ record, and
# RUN mode even where the config asks for MULTIRUN (experiment=ladder sets hydra.mode), which would otherwise make
# each extra rank start a sweep of its own under hydra.sweep.dir (an empty multiruns/<time>/ with a summary).
_CHILD_HYDRA_KEYS = ("hydra.run.dir", "hydra.output_subdir", "hydra.mode")
_CHILD_ERROR = "rank{rank}.error"


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def prepare_child_command(run_dir: Path) -> None:
    """In a multirun job, publish the job's own single-run arguments for Lightning's child processes.

    The job's overrides, the sweep's Hydra overrides that still apply to one run (``hydra.searchpath``, ...), and
    ``hydra.run.dir=<job dir> hydra.output_subdir=null hydra.mode=RUN``.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    overrides = HydraConfig.get().overrides
    hydra_args = [o for o in overrides.hydra if _override_key(o) not in _CHILD_HYDRA_KEYS]
    child = [*overrides.task, *hydra_args, f"hydra.run.dir={run_dir}", "hydra.output_subdir=null", "hydra.mode=RUN"]
    os.environ[CHILD_ARGV_ENV] = json.dumps(child)


def is_sweep_child() -> bool:
    """This process is an extra rank (``LOCAL_RANK`` > 0) that Lightning started for a job of a sweep."""
    return os.environ.get("LOCAL_RANK", "0") != "0" and CHILD_ARGV_ENV in os.environ


def apply_child_command() -> None:
    """In a child rank started by Lightning, replace the inherited sweep argv by the job's single-run argv."""
    if is_sweep_child():
        sys.argv = [sys.argv[0], *json.loads(os.environ[CHILD_ARGV_ENV])]


def record_child_error(run_dir: Path, error: str) -> None:
    """In a failed child rank of a sweep job: leave ``error`` in the job directory for rank 0 to report."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / _CHILD_ERROR.format(rank=os.environ.get("LOCAL_RANK", "?"))).write_text(error)


def child_errors(run_dir: Path) -> dict[str, str]:
    """``{local rank: error}`` that failed child ranks left in ``run_dir`` (:func:`record_child_error`)."""
    found = sorted(run_dir.glob(_CHILD_ERROR.format(rank="*")), key=lambda p: (len(p.name), p.name))
    return {p.name.removeprefix("rank").removesuffix(".error"): p.read_text().strip() for p in found}


def _reap(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for ``procs`` to exit; terminate, then kill, those still running after ``timeout_s``."""
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
            continue
        except subprocess.TimeoutExpired:
            proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def teardown_distributed() -> None:
    """Leave no process group behind: Hydra multirun runs the next job in this same process.

    DeepSpeed caches its process groups in module globals; its own ``destroy_process_group`` releases them
    too, otherwise the next DeepSpeed job of a sweep fails with "Group ... is not registered". ZeRO-3 also
    counts modules and parameters in process-wide state, which this process would carry into the next job while the
    ranks Lightning starts for it count from zero (``_compat.deepspeed_internals.reset_zero3_counters``).
    """
    if "deepspeed" in sys.modules:
        from lightning_trainopt._compat.deepspeed_internals import reset_zero3_counters

        reset_zero3_counters()
    restore_builtin_linear()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def end_job(timeout_s: float = 30.0) -> None:
    """After a sweep job failed on rank 0: let its child ranks go, wait for them, and tear the process group down.

    The process group goes first: a child blocked in a collective then sees its peer leave and fails (and exits,
    see the module docstring); one that does not exit within ``timeout_s`` is terminated.
    """
    procs = take_observed_children()
    teardown_distributed()
    _reap(procs, timeout_s)


def snapshot_env() -> dict[str, str]:
    return dict(os.environ)


def restore_env(snapshot: dict[str, str]) -> None:
    """Undo what a job's launcher set (MASTER_PORT, WORLD_SIZE, ...), so the next job of a sweep starts clean."""
    for key in set(os.environ) - set(snapshot):
        del os.environ[key]
    for key, value in snapshot.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
