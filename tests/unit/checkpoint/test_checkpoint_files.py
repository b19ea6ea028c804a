import os
from pathlib import Path

import pytest

from lightning_trainopt.checkpoint.files import BACKUP_MARK, commit_staged, discard_staged, staging_path


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
