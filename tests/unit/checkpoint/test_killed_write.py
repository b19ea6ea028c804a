"""A checkpoint write SIGKILLed half-way leaves the last good checkpoint, which ``ckpt_path=last`` then finds.

Each case writes a good checkpoint, starts a second write of the same checkpoint in another process, SIGKILLs that
process where it stalls (inside the file, between a directory's parts, between the commit's two renames), and asks
``ckpt_path=last`` / ``auto`` for the checkpoint to resume from.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_trainopt.checkpoint.files import save_directory_checkpoint, write_file_atomic
from lightning_trainopt.checkpoint.verify import auto_resume_checkpoint, newest_complete_checkpoint
from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env
from tests.helpers.one_process import OneProcess

WORKER = Path(__file__).with_name("_killed_write.py")
OLD = torch.full((250_000,), 1.0)


def _kill_while_writing(mode: str, path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(path)],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "STALLED" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the writer ended before it stalled"
            assert time.monotonic() < deadline
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize(
    ("mode", "resolve"),
    [
        ("file", newest_complete_checkpoint),
        ("directory", newest_complete_checkpoint),
        ("commit", newest_complete_checkpoint),
        ("commit", auto_resume_checkpoint),
    ],
    ids=["file-last", "directory-last", "commit-last", "commit-auto"],
)
def test_a_write_killed_half_way_leaves_the_last_good_checkpoint(tmp_path, mode, resolve):
    path = tmp_path / "last.ckpt"
    if mode == "file":
        write_file_atomic(path, lambda f: torch.save({"w": OLD}, f))
    else:

        def write(staging):
            os.makedirs(staging)
            for part in ("part0.pt", "part1.pt"):
                torch.save({"w": OLD}, os.path.join(staging, part))

        save_directory_checkpoint(OneProcess(), path, write)
    _kill_while_writing(mode, path)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert leftovers, "the kill left nothing behind: it did not land inside the write"
    if mode == "commit":
        assert not path.exists()  # caught between the renames: only the moved-aside copy exists

    assert resolve(tmp_path) == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # restored, leftovers removed
    parts = [path] if mode == "file" else [path / "part0.pt", path / "part1.pt"]
    for part in parts:
        torch.testing.assert_close(torch.load(part)["w"], OLD)
