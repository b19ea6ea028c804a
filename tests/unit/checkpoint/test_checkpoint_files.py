import os
from pathlib import Path

import pytest

from lightning_trainopt.checkpoint.files import BACKUP_MARK, commit_staged, discard_staged, staging_path
from tests.helpers.one_process import OneProcess


def test_file_commit_replaces_atomically(tmp_path):
    final = tmp_path / "last.ckpt"
    final.write_text("old")
    staged = staging_path(final)
    assert os.path.dirname(staged) == str(tmp_path)
    Path(staged).write_text("new")
    commit_staged(staged, final)
    assert final.read_text() == "new"
    assert not os.path.exists(staged)


def test_directory_commit_replaces_and_leaves_no_backup(tmp_path):
    final = tmp_path / "step3.ckpt"
    (final / "checkpoint").mkdir(parents=True)
    (final / "checkpoint" / "old.pt").write_text("old")
    staged = staging_path(final)
    os.makedirs(os.path.join(staged, "checkpoint"))
    Path(staged, "checkpoint", "new.pt").write_text("new")
    commit_staged(staged, final)
    assert (final / "checkpoint" / "new.pt").exists()
    assert not (final / "checkpoint" / "old.pt").exists()
    assert not [p for p in tmp_path.iterdir() if BACKUP_MARK in p.name]


def test_interrupted_write_keeps_last_good_checkpoint(tmp_path):
    final = tmp_path / "last.ckpt"
    final.write_text("good")
    staged = staging_path(final)
    Path(staged).write_text("half-writ")  # the writer died here: commit never ran
    assert final.read_text() == "good"
    discard_staged(staged)
    assert not os.path.exists(staged)
    with pytest.raises(FileNotFoundError):
        commit_staged(staged, final)
    assert final.read_text() == "good"


def test_crash_between_directory_renames_keeps_a_complete_copy(tmp_path, monkeypatch):
    final = tmp_path / "ck"
    final.mkdir()
    (final / "w.pt").write_text("good")
    staged = staging_path(final)
    os.makedirs(staged)
    calls = []
    real_replace = os.replace

    def dying_replace(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        commit_staged(staged, final)
    backups = [p for p in tmp_path.iterdir() if BACKUP_MARK in p.name]
    assert len(backups) == 1
    assert (backups[0] / "w.pt").read_text() == "good"


# --------------------------------------------------------------------------- a real full disk
@pytest.fixture
def tiny_disk(tmp_path):
    from tests.helpers.tmpfs import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def _big(n_floats):
    import torch

    return {"w": torch.arange(n_floats, dtype=torch.float32)}


def test_full_disk_keeps_the_previous_file_and_leaves_no_partial(tiny_disk):
    import torch

    from lightning_trainopt.checkpoint.files import write_file_atomic
    from lightning_trainopt.exceptions import CheckpointWriteError

    final = tiny_disk / "last.ckpt"
    write_file_atomic(final, lambda f: torch.save(_big(1000), f))
    with pytest.raises(CheckpointWriteError, match=r"last\.ckpt: No space left on device \(ENOSPC\)"):
        write_file_atomic(final, lambda f: torch.save(_big(400_000), f))  # 1.6 MB on a 1 MiB disk
    assert os.listdir(tiny_disk) == ["last.ckpt"]  # the staging file is gone
    assert torch.equal(torch.load(final)["w"], torch.arange(1000, dtype=torch.float32))


def _write_dir(n_floats):
    import torch

    def write(staging):
        os.makedirs(os.path.join(staging, "checkpoint"))
        torch.save(_big(n_floats), os.path.join(staging, "checkpoint", "mp_rank_00_model_states.pt"))

    return write


def test_directory_checkpoint_is_sealed_with_a_manifest(tmp_path):
    import json

    from lightning_trainopt.checkpoint.files import MANIFEST, save_directory_checkpoint

    final = tmp_path / "step2.ckpt"
    save_directory_checkpoint(OneProcess(), final, _write_dir(10))
    files = json.loads((final / MANIFEST).read_text())["files"]
    part = final / "checkpoint" / "mp_rank_00_model_states.pt"
    assert files == {"checkpoint/mp_rank_00_model_states.pt": part.stat().st_size}
    assert os.listdir(tmp_path) == ["step2.ckpt"]


def test_full_disk_keeps_the_previous_directory(tiny_disk):
    from lightning_trainopt.checkpoint.files import save_directory_checkpoint
    from lightning_trainopt.checkpoint.verify import checkpoint_problem
    from lightning_trainopt.exceptions import CheckpointWriteError

    final = tiny_disk / "last.ckpt"
    save_directory_checkpoint(OneProcess(), final, _write_dir(1000))
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):
        save_directory_checkpoint(OneProcess(), final, _write_dir(400_000))
    assert os.listdir(tiny_disk) == ["last.ckpt"]
    assert checkpoint_problem(final) is None


def test_a_rank_whose_disk_fills_stops_every_rank_from_committing(tiny_disk):
    # Before: each rank only waited at a barrier, so rank 0 committed a checkpoint without rank 1's shard.
    import socket
    import subprocess
    import sys

    from lightning_trainopt.checkpoint.files import save_directory_checkpoint
    from lightning_trainopt.checkpoint.verify import checkpoint_problem
    from tests.helpers.compose import REPO_ROOT

    final = tiny_disk / "last.ckpt"
    save_directory_checkpoint(OneProcess(), final, _write_dir(1000))  # the previous good checkpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = "tests/unit/checkpoint/_two_rank_save.py"
    ranks = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(final), port],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert "rank 0: could not write checkpoint" in outs[0]
    assert "another rank failed to write its part" in outs[0]
    assert "rank 1: could not write checkpoint" in outs[1]
    assert "ENOSPC" in outs[1]
    assert os.listdir(tiny_disk) == ["last.ckpt"]  # no staging directory left
    assert checkpoint_problem(final) is None
    assert sorted(os.listdir(final / "checkpoint")) == ["mp_rank_00_model_states.pt"]  # the previous one
