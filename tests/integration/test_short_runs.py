"""Defaults fit any run length: smoke runs of 1-5 optimizer steps train, with every figure, under every preset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_trainopt.launch.train import train
from tests.helpers.compose import REPO_ROOT, TINY, compose_config
from tests.helpers.runif import RunIf

# The tiny model and run of the other app tests, with the schedule's defaults (no scheduler.warmup_steps).
_TINY = [o for o in TINY if not o.startswith("scheduler.")]


def _cli(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, json.loads((run_dir / "metrics.json").read_text())


def _assert_every_figure(metrics: dict, steps: int) -> None:
    assert metrics["status"] == "ok"
    assert metrics["global_step"] == steps
    assert metrics["val_loss"] is not None
    assert metrics["memory_breakdown"] is not None
    assert metrics["memory_breakdown"]["step"] == min(1, steps - 1)
    assert metrics["step_time"]["steps"] >= 1
    assert metrics["throughput"]["tokens"] > 0


def test_one_step_of_the_default_job(tmp_path):
    proc, metrics = _cli(tmp_path, "trainer.max_steps=1")
    _assert_every_figure(metrics, 1)
    assert (
        "warmup_cosine: 0 warmup steps of 1 optimizer steps (scheduler.warmup_ratio=0.034)" in proc.stderr + proc.stdout
    )


@RunIf(deepspeed=True)
def test_the_headline_command_as_a_smoke_run(headline_zero3_run):
    # `+strategy=zero3 precision=bf16 trainer.max_steps=3`, one run shared with test_train_app.py (see conftest.py).
    proc, metrics = headline_zero3_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _assert_every_figure(metrics, 3)
    assert metrics["zero_stage"] == 3
    assert "warmup_cosine: 0 warmup steps of 3 optimizer steps" in proc.stderr + proc.stdout
    # No warmup: the first step ran at the peak, the last one on the cosine's floor (min_lr_ratio 0.1).
    assert metrics["optimizer"]["lr_now"] == pytest.approx(0.1 * metrics["optimizer"]["lr"])


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_short_runs_with_every_default_callback_and_the_guards(tmp_path, steps):
    cfg = compose_config(
        [*_TINY, f"trainer.max_steps={steps}", "data=synthetic", "callbacks=[default,non_finite_guard]"], tmp_path
    )
    _assert_every_figure(train(cfg), steps)


def test_a_short_run_with_the_warmup_cosine_callback(tmp_path):
    cfg = compose_config(
        [*_TINY, "trainer.max_steps=3", "data=synthetic", "scheduler=constant", "callbacks=[default,warmup_cosine_lr]"],
        tmp_path,
    )
    schedule = train(cfg)["lr_schedule"]
    assert schedule["warmup_steps"] == 0
    assert schedule["total_steps"] == 3
