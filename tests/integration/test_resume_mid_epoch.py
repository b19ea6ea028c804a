"""SIGKILL a real ``python train.py`` run in the middle of an epoch, rerun it with ``ckpt_path=last``, and compare.

The last test kills the same command three times more at random moments and restarts it each time (see
:func:`test_a_run_killed_three_times_at_random_ends_as_the_uninterrupted_one`).

Each case launches three runs of the same command: one left alone, one killed with SIGKILL (the whole process group,
Lightning's extra rank included) after its checkpoint at step ``STOP``, and the rerun of the killed one with
``ckpt_path=last``. The killed run stalls before step ``STOP + 1`` (``tests/integration/_stall.py``) so that the
kill lands at a known step after its checkpoints are written; nothing after the checkpoint survives a kill, so where
exactly it lands changes nothing else. The corpus is tiny (16 batches of 2 x 2 sequences per epoch), so the
checkpoint is in the middle of the second epoch and the rerun crosses an epoch boundary.
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
import torch

from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env
from tests.helpers.runif import RunIf
from tests.integration._stall import MARK

MAX_STEPS = 40
STOP = 20


def _command(max_steps: int = MAX_STEPS, stop: int = STOP, accumulate: int = 1) -> list[str]:
    """A tiny model on 2 processes; checkpoint and validation at optimizer step ``stop`` (and at the end)."""
    return [
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.ffn_hidden=128",
        "data.seq_len=32",
        "data.batch_size=2",
        # 2400 bytes, a tenth held out: 67 training sequences, 16 batches of 2 ranks x 2 per epoch.
        "data.max_bytes=2400",
        "data.val_fraction=0.1",
        "trainer=ddp_sim",
        f"trainer.max_steps={max_steps}",
        f"trainer.accumulate_grad_batches={accumulate}",
        f"trainer.val_check_interval={stop * accumulate}",  # counted in micro-batches
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup_steps=2",
        "logger=none",
        f"+callbacks.model_checkpoint.every_n_train_steps={stop}",
    ]


# Lightning's warning when it resumes mid-epoch with a loader that has no state (the bug this file guards against).
NOT_RESUMABLE = "not resumable"


def _train(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _kill_after_checkpoint(args: list[str], run_dir: Path, stop: int, timeout: float = 600) -> str:
    """Run ``args`` until it stalls after step ``stop``'s checkpoint, SIGKILL its process group; its output."""
    run_dir.mkdir(parents=True)
    log = run_dir / "killed.out"
    stall = ["+callbacks.stall._target_=tests.integration._stall.StallAt", f"+callbacks.stall.step={stop}"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *args, *stall, f"hydra.run.dir={run_dir}"],
            cwd=REPO_ROOT,
            env=child_env(REPO_ROOT),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    try:
        while MARK not in log.read_text():
            assert proc.poll() is None, f"the run ended before step {stop}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no stall before step {stop}:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone when the run failed on its own
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return log.read_text()


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _case(
    tmp: Path,
    args: list[str],
    stop: int = STOP,
    resume_args: tuple[str, ...] = (),
    refused_args: list[str] | None = None,
) -> dict:
    """The three runs of one case (and, with ``refused_args``, a rerun that must be refused before training)."""
    full = _train(args, tmp / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _kill_after_checkpoint(args, tmp / "killed", stop)
    assert not (tmp / "killed" / "metrics.json").exists(), killed[-3000:]
    refused = None
    if refused_args is not None:
        refused = _train([*args, *refused_args, "ckpt_path=last"], tmp / "killed")
    resumed = _train([*args, *resume_args, "ckpt_path=last"], tmp / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {
        "full": tmp / "full",
        "resumed": tmp / "killed",
        "output": resumed.stdout + resumed.stderr,
        "refused": refused,
    }


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    """ZeRO-2 on 2 processes, micro-batch 2: a preempted data-parallel job."""
    return _case(tmp_path_factory.mktemp("zero2"), [*_command(), "+strategy=zero2"])


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return _case(tmp_path_factory.mktemp("fsdp"), [*_command(), "+strategy=fsdp"])


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    """Tensor parallel over the 2 processes: only the uninterrupted run (the random-kill test is the TP case)."""
    run_dir = tmp_path_factory.mktemp("tp") / "full"
    full = _train([*_command(), "+strategy=tp"], run_dir)
    assert full.returncode == 0, full.stderr[-3000:]
    return {"full": run_dir}


# DDP on 2 processes with 2 micro-batches per optimizer step, continued on 1 process with micro-batch 4: the same 4
# sequences per micro-batch step, so the same samples reach each optimizer step. A rerun on 1 process that keeps
# micro-batch 2 would read 2 sequences per step where the checkpoint counted 4, and is refused before training.
ACCUMULATE = [*_command(MAX_STEPS // 2, STOP // 2, accumulate=2), "+strategy=ddp"]


@pytest.fixture(scope="module")
def ddp_to_one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return _case(
        tmp,
        ACCUMULATE,
        stop=STOP // 2,
        resume_args=("trainer.devices=1", "data.batch_size=4"),
        refused_args=["trainer.devices=1"],
    )


def _assert_continued(case: dict, max_steps: int, stop: int) -> dict:
    """The rerun trained only the steps after the checkpoint, without Lightning's not-resumable warning."""
    assert NOT_RESUMABLE not in case["output"], case["output"][-3000:]
    metrics = _metrics(case["resumed"])
    assert metrics["status"] == "ok"
    assert metrics["global_step"] == max_steps
    per_step = metrics["global_batch_size"] * metrics["seq_len"]
    assert metrics["tokens_this_run"] == (max_steps - stop) * per_step
    return metrics


# Same world size and batch: on CPU in fp32 every kernel and gloo reduction is deterministic and the checkpoint holds
# the exact fp32 weights, optimizer and scheduler state, so with the same data order the rerun repeats the
# uninterrupted run's arithmetic (measured for zero2: identical to the last digit). 1e-6 absolute leaves room for
# rounding only; with the old loader, which read the epoch again from its start, this zero2 case ended at train loss
# 3.2531 against 3.2652 (a 40-step run of the old loader: 3.139 against 2.607).
@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param("zero2", marks=RunIf(deepspeed=True)), "fsdp"])
def test_a_killed_run_resumed_mid_epoch_ends_as_the_uninterrupted_one(case, request):
    runs = request.getfixturevalue(case)
    resumed = _assert_continued(runs, MAX_STEPS, STOP)
    full = _metrics(runs["full"])
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=1e-6)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


# Another world size sums the same gradients in another order (one mean of 4 against the average of two means of 2),
# so the weights agree to rounding, not bit for bit: measured max |difference| 1.5e-8 after 10 AdamW steps. The
# tolerance 1e-5 is far above that and far below what other samples do: AdamW moves each weight by about the learning
# rate (3e-3 here) per step, whatever the gradient's size.
@pytest.mark.slow
def test_a_killed_ddp_run_with_accumulation_resumes_on_one_process(ddp_to_one_process):
    runs = ddp_to_one_process
    metrics = _assert_continued(runs, MAX_STEPS // 2, STOP // 2)
    assert metrics["world_size"] == 1
    assert metrics["micro_batch_size"] == 4
    assert metrics["accumulate_grad_batches"] == 2
    full, resumed = _weights(runs["full"]), _weights(runs["resumed"])
    assert full.keys() == resumed.keys()
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_rerun_with_another_global_batch_is_refused_before_training(ddp_to_one_process):
    refused = ddp_to_one_process["refused"]
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "error: data.batch_size=2 is invalid" in refused.stderr
    assert "data.batch_size=4" in refused.stderr  # the fix: the checkpoint's 4 sequences per batch on 1 process
    # Refused from the checkpoint's saved loop state before the model is built or a process spawned.
    assert "parameters (" not in refused.stdout + refused.stderr


# ----------------------------------------------------------------------------------------- killed at random moments
# The same command, with last.ckpt every 3 steps and each step at least 0.1 s long, so that a kill at a random moment
# lands among steps and checkpoint writes. Neither changes the arithmetic, so the run must end with the losses of the
# fixture's uninterrupted run. Every start is the same command: ckpt_path=auto (the newest complete checkpoint when
# there is one, else a fresh start; a write cut short is discarded).
KILLS = (signal.SIGKILL, signal.SIGTERM, signal.SIGKILL)
OFTEN = ["+callbacks.model_checkpoint.every_n_train_steps=3", "+callbacks.pace._target_=tests.integration._pace.Pace"]


def _often(args: list[str]) -> list[str]:
    return [a for a in args if "every_n_train_steps" not in a] + OFTEN + ["ckpt_path=auto"]


def _newest_checkpoint_time(run_dir: Path) -> float:
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return 0.0
    return max((p.stat().st_mtime for p in ckpts.iterdir() if not p.name.startswith(".")), default=0.0)


def _kill_at_random(args: list[str], run_dir: Path, sig: signal.Signals, delay: float, log: Path) -> None:
    """Start the run, wait for a checkpoint newer than the start and ``delay`` seconds more, send ``sig`` to its
    process group (Lightning's second rank included)."""
    started = time.time()
    with log.open("a") as out:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
            cwd=REPO_ROOT,
            env=child_env(REPO_ROOT),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    try:
        while _newest_checkpoint_time(run_dir) <= started:
            assert proc.poll() is None, f"the run ended before its first checkpoint:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        time.sleep(delay)
        assert proc.poll() is None, f"the run ended before the kill:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, sig)
        proc.wait(timeout=180)  # a SIGTERM-ed run saves and exits by itself
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


# SIGKILL, SIGTERM (a cluster's pre-emption: every rank stops at the next optimizer-step boundary and
# interrupted-step<N>.ckpt is written) and SIGKILL again, each after the attempt's first new checkpoint and a seeded
# random delay. Same world size and batch: the 1e-6 of the test above; a step lost or trained twice moves the loss by
# far more.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "strategy"),
    [pytest.param("zero2", "zero2", marks=RunIf(deepspeed=True)), ("fsdp", "fsdp"), ("tp", "tp")],
)
def test_a_run_killed_three_times_at_random_ends_as_the_uninterrupted_one(case, strategy, request, tmp_path):
    full = _metrics(request.getfixturevalue(case)["full"])
    args = _often([*_command(), f"+strategy={strategy}"])
    run_dir, log = tmp_path / "killed", tmp_path / "killed.out"
    rng = random.Random(f"kill-{strategy}")
    for sig in KILLS:
        _kill_at_random(args, run_dir, sig, rng.uniform(0.0, 0.8), log)
        assert not (run_dir / "metrics.json").exists() or _metrics(run_dir)["status"] != "ok", log.read_text()[-3000:]
    assert list((run_dir / "checkpoints").glob("interrupted-step*.ckpt")), f"SIGTERM saved nothing:\n{log.read_text()}"
    last = _train(args, run_dir)
    assert last.returncode == 0, last.stderr[-3000:]
    resumed = _metrics(run_dir)
    assert resumed["status"] == "ok"
    assert resumed["global_step"] == MAX_STEPS
    assert 0 < resumed["tokens_this_run"] < MAX_STEPS * resumed["global_batch_size"] * resumed["seq_len"]
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=1e-6)
