"""Which checkpoints are complete, and which one ``ckpt_path=last`` resumes from."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from lightning_trainopt.checkpoint.files import MANIFEST, write_manifest
from lightning_trainopt.checkpoint.verify import (
    auto_resume_checkpoint,
    checkpoint_problem,
    newest_complete_checkpoint,
    read_checkpoint_state,
    verify_checkpoint,
)
from lightning_trainopt.exceptions import ConfigError

STATE = {"global_step": 7, "state_dict": {"w": torch.arange(4096, dtype=torch.float32)}}


def _save(path, age_s=0.0):
    torch.save(STATE, path)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def test_a_complete_file_passes(tmp_path):
    assert checkpoint_problem(_save(tmp_path / "a.ckpt")) is None


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: _truncate(_save(p), 0.55), "zip archive is truncated or damaged"),
        (lambda p: p.write_bytes(os.urandom(50_000)), "not a checkpoint"),
        (lambda p: p.write_bytes(b""), "empty"),
    ],
    ids=["truncated", "random-bytes", "empty"],
)
def test_broken_files_are_named(tmp_path, make, problem):
    path = tmp_path / "bad.ckpt"
    make(path)
    assert problem in checkpoint_problem(path)
    with pytest.raises(ConfigError, match=f"ckpt_path='{path}' is invalid: .*{problem}"):
        verify_checkpoint(path)


def test_a_zip_that_is_no_torch_checkpoint(tmp_path):
    import zipfile

    path = tmp_path / "x.ckpt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "hello")
    assert "no data.pkl" in checkpoint_problem(path)


def test_directory_needs_its_manifest_and_sizes(tmp_path):
    ckpt = tmp_path / "step2.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    part = ckpt / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save(STATE, part)
    assert MANIFEST in checkpoint_problem(ckpt)
    write_manifest(ckpt)
    assert checkpoint_problem(ckpt) is None
    _truncate(part, 0.5)
    assert "truncated or replaced" in checkpoint_problem(ckpt)
    part.unlink()
    assert "missing" in checkpoint_problem(ckpt)


def test_last_skips_newer_broken_checkpoints_and_names_them(tmp_path, caplog):
    good = _save(tmp_path / "last.ckpt", age_s=20)
    # The fault-injection case: a half-written top-k file, newer than a good last.ckpt.
    _truncate(_save(tmp_path / "step000010-val4.6352.ckpt", age_s=10), 0.55)
    (tmp_path / ".last.ckpt.partial-1234abcd").write_bytes(b"staging files are never candidates")
    with caplog.at_level(logging.WARNING):
        assert newest_complete_checkpoint(tmp_path) == str(good)
    assert "skipping" in caplog.text
    assert "step000010-val4.6352.ckpt" in caplog.text


def test_last_takes_the_newest_complete_one(tmp_path):
    _save(tmp_path / "step2.ckpt", age_s=20)
    newest = _save(tmp_path / "interrupted-step000003.ckpt", age_s=5)
    assert newest_complete_checkpoint(tmp_path) == str(newest)


def test_last_refuses_when_none_is_complete(tmp_path):
    _truncate(_save(tmp_path / "last.ckpt"), 0.3)
    (tmp_path / "step4.ckpt").write_bytes(os.urandom(1000))
    with pytest.raises(ConfigError, match=r"no complete checkpoint in") as refused:
        newest_complete_checkpoint(tmp_path)
    assert "last.ckpt: the zip archive is truncated" in str(refused.value)
    assert "step4.ckpt: it is not a checkpoint" in str(refused.value)
    with pytest.raises(ConfigError, match="no checkpoint in"):
        newest_complete_checkpoint(tmp_path / "nowhere")


def test_auto_starts_without_checkpoints_and_resumes_the_newest_complete_one(tmp_path, caplog):
    # The first attempt of a pre-emptible job: no folder, then an empty folder: start.
    assert auto_resume_checkpoint(tmp_path / "nowhere") is None
    assert auto_resume_checkpoint(tmp_path) is None
    # A later attempt: the newest complete checkpoint, past a newer one killed half-way.
    good = _save(tmp_path / "last.ckpt", age_s=20)
    _truncate(_save(tmp_path / "step000010.ckpt", age_s=10), 0.5)
    with caplog.at_level(logging.WARNING):
        assert auto_resume_checkpoint(tmp_path) == str(good)
    assert "ckpt_path=auto: skipping" in caplog.text
    assert "step000010.ckpt" in caplog.text


def test_auto_starts_afresh_when_no_checkpoint_is_complete(tmp_path, caplog):
    # Refusing would fail a requeued job for ever on files it cannot use; it starts and says which files were broken.
    _truncate(_save(tmp_path / "last.ckpt"), 0.3)
    with caplog.at_level(logging.WARNING):
        assert auto_resume_checkpoint(tmp_path) is None
    assert "no complete checkpoint" in caplog.text
    assert "last.ckpt: the zip archive is truncated" in caplog.text


def test_state_that_cannot_be_unpickled_is_a_config_error(tmp_path):
    import zipfile

    path = tmp_path / "odd.ckpt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x05garbage")
    with pytest.raises(ConfigError, match=r"its saved state cannot be read"):
        read_checkpoint_state(path)
    assert read_checkpoint_state(_save(tmp_path / "ok.ckpt"))["global_step"] == 7
