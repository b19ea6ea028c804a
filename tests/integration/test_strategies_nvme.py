"""ZeRO-Infinity on 2 CPU processes: optimizer state really lands in swap files under ``strategy.nvme_path``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[2]


def _async_io_ok() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return False
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


@pytest.mark.slow
@RunIf(deepspeed=True)
@pytest.mark.skipif(not _async_io_ok(), reason="DeepSpeed async_io needs libaio-dev (apt-get install -y libaio-dev)")
def test_zero_infinity_swaps_optimizer_state_to_disk(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "r.json"
    # The bench model's fp32 optimizer partition is 1.6M elements per rank (6.5 MB), above DeepSpeed's ~1 MiB
    # minimum for swapping; buffers are sized down from the 1e8-element default so the CPU run stays small.
    cmd = [
        sys.executable, str(ROOT / "bench" / "strategies.py"), "--single", "zero_infinity", "--devices", "2",
        "--max-steps", "3", "--out", str(out),
        "--set", f"nvme_path={nvme}", "params_buffer_size=2000000", "max_in_cpu=0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["offload"] == {"optimizer": "nvme", "param": "nvme"}
    swap_files = [p for p in nvme.rglob("*.swp") if p.stat().st_size > 0]
    assert swap_files, "no swap file was written under nvme_path"
    # fp32 master + 2 moments of this rank's half of the model, at least, are on disk.
    assert report["memory_breakdown"]["optimizer_states"]["nvme"] >= 12 * report["n_params"] // 2
