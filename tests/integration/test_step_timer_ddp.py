"""StepTimer measures exposed DDP communication on 2 CPU (gloo) processes.

``_step_timer_ddp_script.py`` runs three fits in one pair of processes (Lightning's launcher re-executes the script
for rank 1), so pytest itself never joins a process group. On CPU StepTimer reads a fake clock that only the run's own
events move (the script's ``PHASES``: data wait in the dataset, forward and optimizer in a callback ahead of StepTimer,
backward and communication around the probe's mark), so every fraction is exact: the probe's mark must land between
the gradient compute and the reduction, once per reducing backward, for the split to come out as below. Each step
lasts ``data + forward + backward + comm + optimizer`` fake seconds; 9 of the 10 steps are timed (warm-up 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "_step_timer_ddp_script.py"


def _run(out: Path, setups: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), setups],
        env=child_env(ROOT),
        cwd=str(out),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_timer_ddp")
    _run(out, "comm,compute,user_hook")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _fractions(s):
    return {k: v for k, v in s.items() if k.endswith("_frac")}


@pytest.mark.slow
def test_comm_heavy_ddp_is_communication_bound(ranks):
    for rank in ranks:
        run = rank["comm"]
        s = run["summary"]
        assert s["comm_measured"] is True
        assert s["comm_probe"] == "ddp_comm_hook"
        assert s["fetch_timed"] is True
        # Phases(data=1, forward=2, backward=3, comm=8, optimizer=2): 16 s a step.
        assert _fractions(s) == {
            "data_wait_frac": 1 / 16,
            "h2d_frac": 0.0,
            "forward_frac": 2 / 16,
            "backward_frac": 3 / 16,
            "optimizer_frac": 2 / 16,
            "comm_frac": 8 / 16,
            "other_frac": 0.0,
        }
        assert s["step_s"] == 16.0
        assert s["steps"] == 9
        assert s["verdict"] == "communication-bound", s
        assert "exposed communication" in s["reason"]
        assert run["grads_ready"] == run["global_step"] == 10  # one mark per reducing backward


@pytest.mark.slow
def test_compute_heavy_ddp_skips_no_sync_micro_batches(ranks):
    for rank in ranks:
        run = rank["compute"]
        s = run["summary"]
        assert s["comm_measured"] is True
        assert run["num_buckets"] == 4  # the mark comes once per backward, from the last of several buckets
        # Accumulation 2: 20 micro-batches, but the 10 under no_sync reduce nothing, leave no mark and so no backward
        # or comm seconds. Phases(data=1, forward=6, backward=15, comm=1, optimizer=2): 2 + 12 + 15 + 1 + 2 = 32 s.
        assert run["grads_ready"] == run["global_step"] == 10
        assert _fractions(s) == {
            "data_wait_frac": 2 / 32,
            "h2d_frac": 0.0,
            "forward_frac": 12 / 32,
            "backward_frac": 15 / 32,
            "optimizer_frac": 2 / 32,
            "comm_frac": 1 / 32,
            "other_frac": 0.0,
        }
        assert s["step_s"] == 32.0
        assert s["verdict"] == "compute-bound", s


@pytest.mark.slow
def test_user_hook_is_left_alone_and_comm_unmeasured(ranks):
    for rank in ranks:
        run = rank["user_hook"]
        s = run["summary"]
        assert run["user_hook_calls"] >= run["global_step"] == 10  # the user's hook kept reducing every step
        assert run["grads_ready"] == 0
        assert s["comm_measured"] is False
        assert s["comm_probe"] is None
        assert "user_hook" in s["comm_note"]
        assert "does not replace it" in s["comm_note"]
        # Phases(data=1, forward=5, optimizer=2), no probe mark: 8 s a step, and no comm fraction at all.
        assert _fractions(s) == {
            "data_wait_frac": 1 / 8,
            "h2d_frac": 0.0,
            "forward_frac": 5 / 8,
            "backward_frac": 0.0,
            "optimizer_frac": 2 / 8,
            "other_frac": 0.0,
        }
        assert s["verdict"] == "compute-bound", s


@pytest.mark.slow
@RunIf(min_cuda_gpus=1)
def test_cuda_event_path_and_lightning_registered_hook(tmp_path):
    _run(tmp_path, "gpu_comm,gpu_user_hook")
    result = json.loads((tmp_path / "rank0.json").read_text())
    run = result["gpu_comm"]
    s = run["summary"]
    assert s["comm_measured"] is True
    assert s["comm_probe"] == "ddp_comm_hook"
    assert 0.0 <= s["comm_frac"] < 1.0
    assert run["grads_ready"] == run["global_step"] == 10
    assert sum(_fractions(s).values()) == pytest.approx(1.0)
    hooked = result["gpu_user_hook"]["summary"]
    assert hooked["comm_measured"] is False
    assert "fp16_compress_hook" in hooked["comm_note"]
