"""Kill a real 2-process ``python train.py`` run at random moments, restart it each time with the same command, and
end with the loss of the run that was never interrupted: nothing lost, nothing trained twice.

For each strategy (DeepSpeed ZeRO-2, FSDP2, whose checkpoints are DCP directories) one run goes uninterrupted, and one
is killed three times: SIGKILL twice and SIGTERM once (a cluster's pre-emption: Lightning stops every rank at the next
step boundary and ``ResumableCheckpoint`` writes ``interrupted-step<N>.ckpt``), each signal sent to the whole process
group, Lightning's second rank included. Each kill waits for the attempt's first new checkpoint and then a seeded
random delay, so it lands in a step or in the middle of a checkpoint write; every start is the same command with
``ckpt_path=auto`` (the newest complete checkpoint when there is one, else a fresh start; a write cut short is
discarded).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

MAX_STEPS = 48
# Every start, the first included: resume from the newest complete checkpoint when there is one, else start.
RESUME = "ckpt_path=auto"
KILLS = (signal.SIGKILL, signal.SIGTERM, signal.SIGKILL)


def _command(strategy: str) -> list[str]:
    """A tiny model on 2 processes, last.ckpt every 3 steps, each step at least 0.1 s long."""
    return [
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.ffn_hidden=128",
        "data.seq_len=32",
        "data.batch_size=2",
        "data.max_bytes=2400",  # 16 batches of 2 ranks x 2 per epoch: the kills land in several epochs
        "data.val_fraction=0.1",
        "trainer=ddp_sim",
        f"+strategy={strategy}",
        f"trainer.max_steps={MAX_STEPS}",
        "trainer.val_check_interval=16",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup_steps=2",
        "logger=none",
        "+callbacks.model_checkpoint.every_n_train_steps=3",
        "+callbacks.pace._target_=tests.integration._pace.Pace",
    ]


def _popen(args: list[str], run_dir: Path, log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
            cwd=REPO_ROOT,
            env=child_env(REPO_ROOT),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _newest_checkpoint_time(run_dir: Path) -> float:
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return 0.0
    return max((p.stat().st_mtime for p in ckpts.iterdir() if not p.name.startswith(".")), default=0.0)


def _kill_once(args: list[str], run_dir: Path, sig: signal.Signals, delay: float, log: Path) -> None:
    """Start the run, wait for a checkpoint newer than the start and ``delay`` seconds more, send ``sig``."""
    started = time.time()
    proc = _popen(args, run_dir, log)
    deadline = time.monotonic() + 300
    try:
        while _newest_checkpoint_time(run_dir) <= started:
            assert proc.poll() is None, f"the run ended before its first checkpoint:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        time.sleep(delay)
        assert proc.poll() is None, f"the run ended before the kill:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, sig)
        proc.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever a SIGTERM-ed run left, and a failed assertion's
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("zero2", marks=RunIf(deepspeed=True)), "fsdp"])
def test_a_run_killed_three_times_ends_as_the_uninterrupted_one(strategy, tmp_path):
    args = _command(strategy)
    full = subprocess.run(
        [sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / 'full'}"],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert full.returncode == 0, full.stderr[-3000:]

    run_dir, log = tmp_path / "killed", tmp_path / "killed.out"
    rng = random.Random(f"kill-{strategy}")
    for sig in KILLS:
        _kill_once([*args, RESUME], run_dir, sig, rng.uniform(0.0, 0.8), log)
        assert not (run_dir / "metrics.json").exists() or _metrics(run_dir)["status"] != "ok"
    interrupted = sorted(p.name for p in (run_dir / "checkpoints").glob("interrupted-step*.ckpt"))
    assert interrupted, f"SIGTERM wrote no checkpoint:\n{log.read_text()[-3000:]}"

    last = subprocess.run(
        [sys.executable, "train.py", *args, RESUME, f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert last.returncode == 0, last.stderr[-3000:]
    resumed, uninterrupted = _metrics(run_dir), _metrics(tmp_path / "full")
    assert resumed["status"] == "ok"
    assert resumed["global_step"] == MAX_STEPS
    assert 0 < resumed["tokens_this_run"] < MAX_STEPS * resumed["global_batch_size"] * resumed["seq_len"]
    # CPU fp32 with the same world size: every kernel and gloo reduction is deterministic, and the exact loader
    # position is restored, so the restarted run repeats the uninterrupted one's arithmetic (see
    # test_resume_mid_epoch); a step lost or trained twice moves the loss by far more than 1e-6.
    assert resumed["train_loss"] == pytest.approx(uninterrupted["train_loss"], abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(uninterrupted["val_loss"], abs=1e-6)
