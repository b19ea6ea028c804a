"""Runs that several integration test files read: each is launched once per session, not once per file."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.compose import REPO_ROOT
from tests.helpers.slurm import LocalSlurm, slurm_missing


@pytest.fixture(scope="session")
def headline_zero3_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    """README's headline command, ``python train.py +strategy=zero3 precision=bf16``, as typed, for 3 optimizer steps.

    Every other default is kept (data, schedule, callbacks, validation), so one run serves the tests of the documented
    command (test_train_app.py) and of short runs under the defaults (test_short_runs.py). Returns the finished
    process (its console in ``stdout``/``stderr``) and its ``metrics.json`` (``None`` when it wrote none).
    """
    run_dir = tmp_path_factory.mktemp("headline_zero3")
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "+strategy=zero3",
            "precision=bf16",
            "trainer.max_steps=3",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    metrics = run_dir / "metrics.json"
    return proc, json.loads(metrics.read_text()) if metrics.exists() else None


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """A real one-node SLURM (``slurm-wlm`` + ``munge``), started for the session and stopped after it.

    Its daemons, key, state and logs live in a temporary folder; clients reach it through ``SLURM_CONF``, set in
    ``os.environ`` while it runs (``tests/helpers/slurm.py``). Skipped, with the reason, where the packages are not
    installed (``.ci/run`` installs them).
    """
    reason = slurm_missing()
    if reason is not None:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
