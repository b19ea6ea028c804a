"""Ctrl-C a real ``python train.py`` run, then continue it with ``ckpt_path=last``: on 1 process and on 2 (ZeRO-2).

The interrupt is sent as a terminal sends it: SIGINT to the whole process group, Lightning's extra rank included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.compose import REPO_ROOT
from tests.helpers.runif import RunIf

MAX_STEPS = 60
COMMON = [
    f"trainer.max_steps={MAX_STEPS}",
    "+callbacks.model_checkpoint.every_n_train_steps=3",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "data.batch_size=2",
    "data.seq_len=32",
    "data.max_bytes=300000",
]


def _train(args, **kwargs):
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def _interrupt_after_first_checkpoint(proc, run_dir, timeout=300):
    last = run_dir / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + timeout
    while not last.exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no periodic checkpoint appeared"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="one-process"),
        pytest.param(["+strategy=zero2", "trainer=ddp_sim"], id="zero2-two-processes", marks=RunIf(deepspeed=True)),
    ],
)
def test_ctrl_c_saves_a_checkpoint_and_metrics_then_ckpt_path_last_continues(tmp_path, extra):
    args = [*COMMON, *extra, f"hydra.run.dir={tmp_path}"]
    code, out = _interrupt_after_first_checkpoint(_train(args), tmp_path)
    assert code == 130, out[-3000:]
    assert "stopping after this step and saving a checkpoint" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "interrupted"
    stopped_at = metrics["global_step"]
    assert 3 <= stopped_at < MAX_STEPS
    saved = tmp_path / "checkpoints" / f"interrupted-step{stopped_at:06d}.ckpt"
    assert metrics["interrupt_checkpoint"] == str(saved)
    assert saved.exists()

    resumed = subprocess.run(
        [sys.executable, "train.py", *args, "ckpt_path=last"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "ok"
    assert metrics["global_step"] == MAX_STEPS
    # The resumed run trained only the steps that were left: it started from the interrupted step.
    per_step = metrics["global_batch_size"] * metrics["seq_len"]
    assert metrics["tokens_this_run"] == (MAX_STEPS - stopped_at) * per_step
