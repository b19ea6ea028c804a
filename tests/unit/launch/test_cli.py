"""A user error exits 2 with one line (or is recorded as ``status: refused`` in a sweep), wherever it is raised."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
from datetime import datetime

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.launch import cli
from tests.helpers.compose import REPO_ROOT, TINY, compose_config
from tests.helpers.env import child_env


def _instantiate_cost_monitor(cfg):
    instantiate(cfg.callbacks.cost_monitor)


def test_user_error_is_found_behind_hydras_wrappers(tmp_path):
    cfg = compose_config(["callbacks.cost_monitor.target_tokens=1.5"], tmp_path)
    with pytest.raises(InstantiationException) as err:
        _instantiate_cost_monitor(cfg)
    found = cli.user_error(err.value)
    assert isinstance(found, ConfigError)
    assert found.key == "callbacks.cost_monitor.target_tokens"


def test_wrapped_user_error_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_in_multirun", lambda: False)
    cfg = compose_config(["callbacks.cost_monitor.target_tokens=1.5"], tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli._guarded(_instantiate_cost_monitor)(cfg)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: callbacks.cost_monitor.target_tokens=1.5 is invalid: use a whole number")
    assert "Error in call to target" not in err


def test_wrapped_user_error_in_a_sweep_is_recorded_as_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_in_multirun", lambda: True)
    cfg = compose_config(["activations=checkpoint", "activations.activation_checkpointing.every_k=0"], tmp_path)
    cli._guarded(lambda c: [instantiate(node) for node in c.activations.values()])(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "refused"
    assert metrics["error"].startswith("activations.activation_checkpointing.every_k=0 is invalid")


def test_other_errors_hydra_wraps_keep_their_traceback(tmp_path, monkeypatch):
    # A plain bug inside a _target_ (here int("abc")) is not a user error: it keeps Hydra's wrapper and traceback.
    monkeypatch.setattr(cli, "_in_multirun", lambda: False)
    node = {"_target_": "builtins.int", "_args_": ["abc"]}
    with pytest.raises(InstantiationException) as err:
        cli._guarded(lambda cfg: instantiate(node))(compose_config([], tmp_path))
    assert isinstance(err.value.__cause__, ValueError)
    assert cli.user_error(err.value) is None
    assert not (tmp_path / "metrics.json").exists()


def _train(args: list[str], multirun: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *(["-m"] if multirun else []), *TINY, "data=synthetic", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=child_env(REPO_ROOT))


@pytest.mark.slow
def test_cli_refuses_a_bad_optimizer_value_before_the_run_dir_is_touched(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(["optimizer.weight_decay=-0.1", "logger=csv", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: optimizer.weight_decay=-0.1 is invalid" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Only Hydra's own files: no logger directory, checkpoint or metrics.json was created.
    assert {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log"}


@pytest.mark.slow
def test_cli_exits_2_for_an_error_raised_in_a_callbacks_init(tmp_path):
    proc = _train(["callbacks.cost_monitor.target_tokens=1.5", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: callbacks.cost_monitor.target_tokens=1.5 is invalid" in proc.stderr
    assert "Error executing job" not in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sweep_goes_on_past_refused_jobs_and_writes_its_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _train(["callbacks.cost_monitor.target_tokens=1.5,2.5", f"hydra.sweep.dir={sweep}"], multirun=True)
    assert proc.returncode == 2, proc.stderr[-3000:]  # every job refused: no job succeeded
    for job in ("0", "1"):
        assert json.loads((sweep / job / "metrics.json").read_text())["status"] == "refused"
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [row["status"] for row in rows] == ["refused", "refused"]


@pytest.mark.parametrize(
    ("script", "args", "line"),
    [
        # Hydra's own errors (the config does not compose) and a key Hydra accepts that no target takes.
        (
            "train.py",
            ["strategy=zero3"],
            "strategy=zero3: strategy is not in the defaults list; add it with a +: +strategy=zero3",
        ),
        (
            "train.py",
            ["trainer.max_step=20"],
            "trainer.max_step=20: unknown argument of lightning.pytorch.Trainer; did you mean max_steps?",
        ),
        (
            "train.py",
            ["+data.batchsize=8"],
            "data.batchsize=8: unknown argument of lightning_trainopt.data.TextDataModule; did you mean batch_size?",
        ),
        (
            "plan.py",
            ["+optimizer.betaz=[0.9,0.9]"],
            "optimizer.betaz=[0.9, 0.9]: unknown argument of torch.optim.AdamW; did you mean betas?",
        ),
    ],
)
def test_a_misspelt_override_exits_2_with_one_line_and_the_fix(tmp_path, script, args, line):
    cmd = [sys.executable, script, *args, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=child_env(REPO_ROOT))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    assert errors == [f"error: {line}"], proc.stderr[-3000:]
    for hydra_report in ("Traceback", "TypeError", "HYDRA_FULL_ERROR", "Could not override"):
        assert hydra_report not in proc.stderr


def test_an_existing_run_directory_keeps_its_hydra_record(tmp_path):
    when = datetime(2026, 11, 30, 18, 5, 9)
    argv = ["train.py", f"hydra.run.dir={tmp_path}", "ckpt_path=last"]
    assert cli.keep_earlier_hydra_record(argv, when) == argv  # a new directory: Hydra's own .hydra/
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("x")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_text("weights")
    assert cli.keep_earlier_hydra_record(argv, when) == [*argv, "hydra.output_subdir=.hydra/2026-11-30_18-05-09"]
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "x"
    # Sweeps, and Lightning's DDP children (they set hydra.output_subdir themselves), are left alone.
    assert cli.keep_earlier_hydra_record(["train.py", "-m", *argv[1:]], when) == ["train.py", "-m", *argv[1:]]
    child = [*argv, "hydra.output_subdir=null"]
    assert cli.keep_earlier_hydra_record(child, when) == child


def _record(run_dir, overrides: str, written: datetime) -> None:
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (hydra_dir / name).write_text(overrides if name == "overrides.yaml" else name)
    os.utime(hydra_dir / "config.yaml", (written.timestamp(), written.timestamp()))


@pytest.mark.parametrize("metrics", [None, {"status": "refused", "error": "optimizer.lr=-1 is invalid"}])
def test_a_refused_command_does_not_own_the_run_directorys_record(tmp_path, metrics):
    # Nothing trained here (no checkpoint; no metrics.json, or a sweep's refusal): the refused command's record moves
    # to .hydra/<when it was written>/ and the next command takes the top level.
    refused_at = datetime(2026, 11, 30, 17, 0, 1)
    _record(tmp_path, "- optimizer.lr=-1\n", refused_at)
    if metrics is not None:
        (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    argv = ["train.py", "trainer.max_steps=12", f"hydra.run.dir={tmp_path}"]
    assert cli.keep_earlier_hydra_record(argv, datetime(2026, 11, 30, 18, 5, 9)) == argv
    aside = tmp_path / ".hydra" / "2026-11-30_17-00-01"
    assert sorted(p.name for p in aside.iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert (aside / "overrides.yaml").read_text() == "- optimizer.lr=-1\n"
    assert sorted(p.name for p in (tmp_path / ".hydra").iterdir()) == ["2026-11-30_17-00-01"]
    # A second refusal written in the same second keeps both records aside.
    _record(tmp_path, "- optimizer.lr=-2\n", refused_at)
    assert cli.keep_earlier_hydra_record(argv) == argv
    assert (tmp_path / ".hydra" / "2026-11-30_17-00-01_1" / "overrides.yaml").read_text() == "- optimizer.lr=-2\n"


def test_a_run_that_wrote_metrics_keeps_its_record(tmp_path):
    _record(tmp_path, "- trainer.max_steps=12\n", datetime(2026, 11, 30, 17, 0, 1))
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "diverged"}))
    argv = ["train.py", f"hydra.run.dir={tmp_path}", "ckpt_path=last"]
    when = datetime(2026, 11, 30, 18, 5, 9)
    assert cli.keep_earlier_hydra_record(argv, when) == [*argv, "hydra.output_subdir=.hydra/2026-11-30_18-05-09"]
    assert (tmp_path / ".hydra" / "overrides.yaml").read_text() == "- trainer.max_steps=12\n"


def test_a_refusal_reaches_the_runs_log_file_and_the_terminal_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_in_multirun", lambda: False)
    root = logging.getLogger()
    log_file = logging.FileHandler(tmp_path / "train.log")
    console = logging.StreamHandler(sys.stdout)
    root.addHandler(log_file)
    root.addHandler(console)
    try:

        def refused(cfg):
            raise ConfigError("optimizer.lr", -1, "use a positive learning rate, e.g. 3e-4.")

        with pytest.raises(SystemExit) as exit_:
            cli._guarded(refused)(None)
    finally:
        root.removeHandler(log_file)
        root.removeHandler(console)
        log_file.close()
    assert exit_.value.code == 2
    line = "error: optimizer.lr=-1 is invalid: use a positive learning rate, e.g. 3e-4."
    assert line in (tmp_path / "train.log").read_text()
    out = capsys.readouterr()
    assert out.err == line + "\n"
    assert line not in out.out  # already on stderr: not printed a second time by the console handler


@pytest.mark.slow
def test_the_first_command_that_trains_owns_the_run_directorys_record(tmp_path):
    run_dir = tmp_path / "run"
    common = ["callbacks=none", "logger=none", f"hydra.run.dir={run_dir}"]
    refused = _train(["trainer.max_steps=2", "scheduler.warmup_steps=5", *common])
    assert refused.returncode == 2, refused.stderr[-3000:]
    trained = _train(["trainer.max_steps=2", "scheduler.warmup_steps=1", *common])
    assert trained.returncode == 0, trained.stderr[-3000:]
    top = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
    assert "scheduler.warmup_steps=1" in top
    (aside,) = [p for p in (run_dir / ".hydra").iterdir() if p.is_dir()]
    assert "scheduler.warmup_steps=5" in OmegaConf.load(aside / "overrides.yaml")
    log = (run_dir / "train.log").read_text()
    assert "error: scheduler.warmup_steps=5 is invalid" in log


def test_a_sweep_job_whose_checkpoint_write_failed_keeps_its_metrics(tmp_path, monkeypatch):
    from lightning_trainopt.exceptions import CheckpointWriteError

    monkeypatch.setattr(cli, "_in_multirun", lambda: True)
    monkeypatch.setattr(cli, "_run_dir", lambda: tmp_path)
    written = '{"status": "failed", "error": "...", "global_step": 8}'
    (tmp_path / "metrics.json").write_text(written)
    cli._refuse(CheckpointWriteError(str(tmp_path / "last.ckpt"), "No space left on device (ENOSPC)"))
    assert (tmp_path / "metrics.json").read_text() == written
    (tmp_path / "metrics.json").unlink()  # a job that failed before train() wrote anything: recorded as failed
    cli._refuse(CheckpointWriteError(str(tmp_path / "last.ckpt"), "No space left on device (ENOSPC)"))
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "failed"
