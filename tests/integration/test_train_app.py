"""The training app end to end: real fits through train(cfg), and the CLI as a user types it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.launch.train import train
from tests.helpers.compose import REPO_ROOT, TINY, compose_config
from tests.helpers.runif import RunIf
from tests.helpers.scaler_probe import SEEN

# The documented metrics.json schema (README "metrics.json"): key -> accepted types.
SCHEMA = {
    "status": str,
    "model": str,
    "n_params": int,
    "strategy": str,
    "zero_stage": (int, type(None)),
    "precision": str,
    "world_size": int,
    "data_parallel_size": int,
    "parallel_dims": dict,
    "devices": int,
    "global_step": int,
    "train_loss": float,
    "val_loss": float,
    "tokens_seen": int,
    "tokens_per_sec": float,
    "wall_seconds": float,
}


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


def check_schema(metrics: dict) -> None:
    missing = [k for k in SCHEMA if k not in metrics]
    assert not missing, f"metrics.json lacks {missing}"
    wrong = {k: type(metrics[k]).__name__ for k, t in SCHEMA.items() if not isinstance(metrics[k], t)}
    assert not wrong, f"wrong types: {wrong}"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16_true"])
def test_fit_per_precision_writes_metrics(tmp_path, precision):
    # 5 steps with validation every 2: the app adds a validation pass at the last step.
    cfg = compose_config(
        [*TINY, "trainer.max_steps=5", f"precision={precision}", "data=synthetic", "callbacks=none"], tmp_path
    )
    metrics = train(cfg)
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    check_schema(on_disk)
    assert on_disk["precision"] == precision
    assert on_disk["strategy"] == "singledevice"  # as README documents it, not Lightning's class name
    assert on_disk["global_step"] == 5
    assert on_disk["tokens_seen"] == 5 * 4 * 32
    assert on_disk["zero_stage"] is None
    assert math.isfinite(on_disk["train_loss"])
    assert math.isfinite(on_disk["val_loss"])
    assert metrics["n_params"] == on_disk["n_params"]


def test_validation_loss_falls_on_the_stdlib_corpus(tmp_path):
    overrides = [
        *TINY,
        "trainer.max_steps=40",
        "scheduler.warmup_steps=4",
        "trainer.val_check_interval=40",
        "data.max_bytes=500000",
        "optimizer.lr=0.005",
        "callbacks=none",
    ]
    metrics = train(compose_config(overrides, tmp_path))
    # ln(256) = 5.55 nats is the loss of a uniform guess over bytes; real text is learnt quickly.
    assert metrics["val_loss"] < 3.6


def test_a_run_the_non_finite_guard_stops_is_recorded_as_stopped(tmp_path):
    overrides = [
        *TINY,
        "trainer.max_steps=6",
        "optimizer.lr=1e6",
        "trainer.gradient_clip_val=null",
        "data=synthetic",
        "callbacks=[non_finite_guard]",
        "callbacks.non_finite_guard.policy=stop",
    ]
    train(compose_config(overrides, tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "stopped"
    assert metrics["stopped_by"] == "NonFiniteGuard"
    assert metrics["stopped_at_step"] == metrics["non_finite"]["stopped_at_step"] < 6
    assert metrics["global_step"] < 6


def test_unknown_options_list_the_choices_without_traceback():
    # README "The config tree": an unknown preset gets one error: line with the group's presets and exit code 2.
    for arg, line in (
        ("model=nope", "error: model=nope: no such preset; conf/model/ has gpt_125m, gpt_1b, gpt_350m, gpt_tiny,"),
        ("+strategy=zero9", "error: strategy=zero9: no such preset; did you mean strategy=zero3? conf/strategy/ has"),
    ):
        proc = run_cli(arg)
        assert proc.returncode == 2
        assert proc.stderr.startswith(line), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (("precision=fp16", "trainer.accelerator=cpu"), "precision"),
        (("optimizer.lr=-1",), "optimizer.lr"),
        (("data=text_file", "data.path=/nonexistent/corpus"), "data.path"),
    ],
)
def test_bad_input_exits_with_one_clear_line(tmp_path, args, key):
    # Aimed at an existing run: its record of how it was trained (.hydra/) must survive the refused command.
    record = tmp_path / "run" / ".hydra" / "config.yaml"
    record.parent.mkdir(parents=True)
    record.write_text("the original run's config\n")
    (tmp_path / "run" / "checkpoints").mkdir()
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_text("the original run's weights\n")
    proc = run_cli(*args, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"error: {key}=")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()
    assert record.read_text() == "the original run's config\n"
    assert len(list(record.parent.glob("*/config.yaml"))) == 1  # this invocation's record, in its own subfolder


@RunIf(min_cuda_gpus=1)
def test_fp16_fit_on_gpu_uses_the_configured_loss_scaler(tmp_path):
    overrides = [
        *TINY,
        "precision=fp16",
        "precision.init_scale=1024",
        "precision.growth_interval=7",
        "trainer.accelerator=gpu",
        "data=synthetic",
        "callbacks=none",
        "+callbacks.probe._target_=tests.helpers.scaler_probe.ScalerProbe",
    ]
    metrics = train(compose_config(overrides, tmp_path))
    assert metrics["trainer_precision"] == "16-mixed"
    assert SEEN == {"plugin": "MixedPrecision", "init_scale": 1024.0, "growth_interval": 7, "enabled": True}
    assert math.isfinite(metrics["train_loss"])


@RunIf(deepspeed=True)
def test_documented_zero3_command_runs_stage_3(headline_zero3_run):
    # The command as README gives it, for 3 steps: one run shared with test_short_runs.py (see conftest.py).
    proc, metrics = headline_zero3_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Lightning's own console handler and Hydra's both printed each Lightning line: once now.
    console = proc.stdout + proc.stderr
    assert console.count("`Trainer.fit` stopped: `max_steps=3` reached.") == 1
    # No third-party chatter a user cannot act on, and no empty figures (Lightning's summary without FLOPs).
    for noise in ("FutureWarning", "is deprecated", "Setting accelerator to CPU", "💡 Tip", "Total FLOPs", "gcc "):
        assert noise not in console, noise
    assert console.count("model gpt_tiny: 836,736 parameters") == 1  # rank 0 only
    check_schema(metrics)
    assert metrics["strategy"] == "zero3"
    assert metrics["zero_stage"] == 3  # as reported by the DeepSpeed engine itself
    assert metrics["precision"] == "bf16"
    # The preset's configured rate, not where the cosine ended (that it is not the first step's rate under warmup is
    # checked in test_multirun.py's sweep, whose runs warm up).
    peak = OmegaConf.load(REPO_ROOT / "lightning_trainopt" / "conf" / "optimizer" / "adamw.yaml").lr
    assert metrics["optimizer"]["name"] == "AdamW"
    assert metrics["optimizer"]["lr"] == pytest.approx(peak)
    assert metrics["optimizer"]["lr_now"] < peak


def test_metrics_report_the_batch_a_micro_batch_finder_chose(tmp_path):
    # The finder lowers data.batch_size and raises accumulation; metrics.json must describe what was trained.
    base = [*TINY, "data.batch_size=8", "trainer.max_steps=2", "data=synthetic", "callbacks=none"]
    finder = "+callbacks.micro_batch_finder._target_=lightning_trainopt.callbacks.MicroBatchFinder"
    roomy = train(compose_config([*base, finder, "+callbacks.micro_batch_finder.budget_bytes=1e12"], tmp_path / "a"))
    plan = roomy["micro_batch_finder"]
    assert plan["micro_batch"] == 8
    budget = plan["fixed_bytes"] + int(2.5 * plan["per_sample_bytes"])  # room for 2 samples, not 4
    metrics = train(
        compose_config([*base, finder, f"+callbacks.micro_batch_finder.budget_bytes={budget}"], tmp_path / "b")
    )
    assert metrics["micro_batch_finder"]["micro_batch"] == 2
    assert metrics["micro_batch_size"] == 2
    assert metrics["accumulate_grad_batches"] == 4
    assert metrics["global_batch_size"] == 8
    assert metrics["tokens_seen"] == 2 * 8 * 32 == metrics["tokens_this_run"]


def test_resume_with_ckpt_path_last_keeps_the_first_runs_logs(tmp_path):
    # A resume in the same run directory used to reuse the CSV logger's one version folder, and Lightning deleted the
    # first run's metrics.csv. Each invocation now logs into its own version_N folder.
    common = [*TINY, "data=synthetic", "callbacks=[model_checkpoint]", "logger=csv", "trainer.val_check_interval=3"]
    train(compose_config([*common, "trainer.max_steps=3"], tmp_path))
    first = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    metrics = train(compose_config([*common, "trainer.max_steps=6", "ckpt_path=last"], tmp_path))
    assert metrics["global_step"] == 6
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").read_text() == first
    resumed = (tmp_path / "logs" / "version_1" / "metrics.csv").read_text().splitlines()
    header = resumed[0].split(",")
    steps = {int(row.split(",")[header.index("step")]) for row in resumed[1:]}
    assert min(steps) >= 3  # the resumed run's own rows
