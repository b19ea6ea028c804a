"""The one line a DeepSpeed run prints before it compiles an op, and only when the op is not cached."""

from __future__ import annotations

import pytest

from lightning_trainopt.parallel import op_builds
from lightning_trainopt.parallel.op_builds import announce_op_builds, op_builds_needed


def _names(on_cpu, optimizer="none", param="none"):
    return [op.name for op in op_builds_needed(on_cpu, {"optimizer": optimizer, "param": param})]


def test_the_ops_a_run_needs_follow_from_where_it_runs_and_offloads():
    assert _names(on_cpu=False) == []
    assert _names(on_cpu=True) == ["deepspeed_shm_comm"]
    assert _names(on_cpu=False, optimizer="cpu") == ["cpu_adam"]
    assert _names(on_cpu=True, optimizer="nvme", param="nvme") == ["deepspeed_shm_comm", "cpu_adam", "async_io"]
    # Parameter offload alone steps a device optimizer: no CPU Adam, but NVMe still needs async I/O.
    assert _names(on_cpu=False, param="nvme") == ["async_io"]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(op_builds, "extension_build_dir", lambda name: str(tmp_path / name))
    return tmp_path


def test_uncached_ops_are_announced_with_their_reason_and_time(empty_cache):
    line = announce_op_builds(True, {"optimizer": "cpu", "param": "none"})
    assert line is not None
    assert "deepspeed_shm_comm (CPU shared-memory collectives)" in line
    assert "cpu_adam (CPU Adam for optimizer offload)" in line
    assert "about 55 s" in line


def test_a_cached_op_is_not_announced(empty_cache):
    (empty_cache / "deepspeed_shm_comm").mkdir()
    (empty_cache / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert announce_op_builds(True, {"optimizer": "none", "param": "none"}) is None
    line = announce_op_builds(True, {"optimizer": "cpu", "param": "none"})
    assert line is not None
    assert "deepspeed_shm_comm" not in line
    assert "cpu_adam" in line


def test_the_cache_directory_is_torchs_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert op_builds.extension_build_dir("cpu_adam").startswith(str(tmp_path))
