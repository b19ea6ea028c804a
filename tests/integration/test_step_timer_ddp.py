"""StepTimer measures exposed DDP communication on 2 CPU (gloo) processes.

``_step_timer_ddp_script.py`` runs three fits in one pair of processes (Lightning's launcher re-executes the script
for rank 1), so pytest itself never joins a process group.

Fractions measured on the 2-core development machine (load average ~3 from other jobs; 10 steps, 9 timed; four
runs of the script, three of them with bucket_cap_mb=0.3, i.e. two buckets, in the compute setup; both ranks):
comm-heavy comm_frac 0.51-0.60 (backward 0.17-0.25, optimizer 0.05-0.12); compute-heavy comm_frac 0.01-0.07
(forward+backward 0.87-0.95, data_wait <= 0.074). The assertions sit at the verdict thresholds.
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


def _fractions_sum_to_one(s):
    assert sum(v for k, v in s.items() if k.endswith("_frac")) == pytest.approx(1.0)


@pytest.mark.slow
def test_comm_heavy_ddp_is_communication_bound(ranks):
    for rank in ranks:
        run = rank["comm"]
        s = run["summary"]
        assert s["comm_measured"] is True
        assert s["comm_probe"] == "ddp_comm_hook"
        assert s["comm_frac"] > 0.25, s  # the verdict's threshold
        assert s["comm_frac"] > s["backward_frac"], s  # the wait dwarfs the gradient compute
        assert s["verdict"] == "communication-bound", s
        assert "exposed communication" in s["reason"]
        assert run["grads_ready"] == run["global_step"] == 10  # one mark per reducing backward
        _fractions_sum_to_one(s)


@pytest.mark.slow
def test_compute_heavy_ddp_measures_little_comm_and_skips_no_sync_micro_batches(ranks):
    for rank in ranks:
        run = rank["compute"]
        s = run["summary"]
        assert s["comm_measured"] is True
        assert s["comm_frac"] < 0.2, s
        assert s["forward_frac"] + s["backward_frac"] > 0.5, s
        assert s["verdict"] == "compute-bound", s
        assert run["num_buckets"] == 4  # the mark comes once per backward, from the last of several buckets
        # Accumulation 2: 20 micro-batches, but the 10 under no_sync reduce nothing and leave no mark.
        assert run["grads_ready"] == run["global_step"] == 10
        _fractions_sum_to_one(s)


@pytest.mark.slow
def test_user_hook_is_left_alone_and_comm_unmeasured(ranks):
    for rank in ranks:
        run = rank["user_hook"]
        s = run["summary"]
        assert run["user_hook_calls"] >= run["global_step"] == 10  # the user's hook kept reducing every step
        assert run["grads_ready"] == 0
        assert s["comm_measured"] is False
        assert "comm_frac" not in s
        assert s["comm_probe"] is None
        assert "user_hook" in s["comm_note"]
        assert "does not replace it" in s["comm_note"]
        assert s["verdict"] != "communication-bound"
        _fractions_sum_to_one(s)


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
    _fractions_sum_to_one(s)
    hooked = result["gpu_user_hook"]["summary"]
    assert hooked["comm_measured"] is False
    assert "fp16_compress_hook" in hooked["comm_note"]
