"""ZeRO-Infinity on 2 CPU processes: optimizer state really lands in swap files under ``strategy.nvme_path``, and a
run stopped at step 3 and resumed continues with the same losses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[2]


def _async_io_ok() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return False
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _run(tmp_path: Path, name: str, *args: object) -> tuple[dict, Path]:
    """One ``zero_infinity`` fit on 2 processes with its own swap folder; (report, swap folder)."""
    nvme = tmp_path / f"nvme_{name}"
    nvme.mkdir()
    out = tmp_path / f"{name}.json"
    # The bench model's fp32 optimizer partition is 1.6M elements per rank (6.5 MB), above DeepSpeed's ~1 MiB
    # minimum for swapping; buffers are sized down from the 1e8-element default so the CPU run stays small.
    cmd = [
        sys.executable, str(ROOT / "bench" / "strategies.py"), "--single", "zero_infinity", "--devices", "2",
        "--precision", "32-true", "--epoch-batches", "3", "--max-steps", "6", *map(str, args), "--out", str(out),
        "--set", f"nvme_path={nvme}", "params_buffer_size=2000000", "max_in_cpu=0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=child_env(ROOT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), nvme


@pytest.mark.slow
@RunIf(deepspeed=True)
@pytest.mark.skipif(not _async_io_ok(), reason="DeepSpeed async_io needs libaio-dev (apt-get install -y libaio-dev)")
def test_zero_infinity_swaps_optimizer_state_to_disk_and_resumes_the_same_trajectory(tmp_path):
    ckpt_dir = tmp_path / "ck"
    full, nvme = _run(tmp_path, "full", "--ckpt-dir", ckpt_dir, "--ckpt-every", 3)

    # Swap to disk (the uninterrupted run).
    assert full["zero_stage"] == 3
    assert full["offload"] == {"optimizer": "nvme", "param": "nvme"}
    swap_files = [p for p in nvme.rglob("*.swp") if p.stat().st_size > 0]
    assert swap_files, "no swap file was written under nvme_path"
    # fp32 master + 2 moments of this rank's half of the model are on disk, except the no-decay param group (the
    # nine RMSNorm weights, 128 elements per rank each): as a sub-group of 4.6 KB it is below DeepSpeed's 1 MiB
    # minimum swap size and stays in CPU memory (measured: 19,365,888 B = 12 x (n/2 - 9 x 128) on disk).
    norm_elements = 9 * 128
    assert full["memory_breakdown"]["optimizer_states"]["nvme"] >= 12 * (full["n_params"] // 2 - norm_elements)

    # Stop at step 3 (an epoch boundary: 3 batches per epoch), resume from that checkpoint into a fresh swap folder.
    ckpt = ckpt_dir / "step3.ckpt"
    assert ckpt.is_dir()
    assert not [p for p in ckpt_dir.iterdir() if ".partial-" in p.name]  # staging paths were committed
    resumed, nvme_resumed = _run(tmp_path, "resumed", "--resume", ckpt)
    assert [p for p in nvme_resumed.rglob("*.swp") if p.stat().st_size > 0], "the resumed run swapped nothing"
    assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    # Same tolerance as the other presets (test_strategies.py): fp32 on CPU with gloo is deterministic, and the swap
    # files hold the exact fp32 bytes that were written (async I/O copies, no compression), so swapping adds no
    # rounding; the checkpoint holds the exact fp32 master weights and Adam moments.
    for step, loss in resumed["losses"].items():
        assert abs(loss - full["losses"][step]) <= 1e-6, (step, loss, full["losses"][step])
