"""Hydra multirun x Lightning's subprocess launcher, done properly.

Lightning starts ranks 1..N-1 of a DDP/DeepSpeed job by re-running the script with ``sys.argv``. Under
``python train.py -m ...`` that argv is the whole sweep, so every extra rank would re-run every job (the known
Lightning/Hydra trap: lightning-hydra-template #393, Lightning PR #18175). Instead, rank 0 of each job leaves
the single-run command of *its* job in the environment that the children inherit, and the children replace
their argv with it before Hydra parses anything: one run, in the job's own directory, with the job's overrides.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["CHILD_ARGV_ENV", "apply_child_command", "prepare_child_command", "restore_env", "snapshot_env"]

CHILD_ARGV_ENV = "TRAINOPT_CHILD_ARGV"


def prepare_child_command(run_dir: Path) -> None:
    """In a multirun job, publish the job's own single-run arguments for Lightning's child processes."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    overrides = list(HydraConfig.get().overrides.task)
    os.environ[CHILD_ARGV_ENV] = json.dumps([*overrides, f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"])


def apply_child_command() -> None:
    """In a child rank started by Lightning, replace the inherited sweep argv by the job's single-run argv."""
    if os.environ.get("LOCAL_RANK", "0") != "0" and CHILD_ARGV_ENV in os.environ:
        sys.argv = [sys.argv[0], *json.loads(os.environ[CHILD_ARGV_ENV])]


def snapshot_env() -> dict[str, str]:
    return dict(os.environ)


def restore_env(snapshot: dict[str, str]) -> None:
    """Undo what a job's launcher set (MASTER_PORT, WORLD_SIZE, ...), so the next job of a sweep starts clean."""
    for key in set(os.environ) - set(snapshot):
        del os.environ[key]
    for key, value in snapshot.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
