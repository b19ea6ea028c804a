"""A user error exits 2 with one line (or is recorded as ``status: refused`` in a sweep), wherever it is raised."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from lightning_trainopt.app import cli
from lightning_trainopt.exceptions import ConfigError
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
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):
        assert json.loads((sweep / job / "metrics.json").read_text())["status"] == "refused"
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [row["status"] for row in rows] == ["refused", "refused"]


def test_an_existing_run_directory_keeps_its_hydra_record(tmp_path):
    from datetime import datetime

    when = datetime(2026, 11, 30, 18, 5, 9)
    argv = ["train.py", f"hydra.run.dir={tmp_path}", "ckpt_path=last"]
    assert cli.keep_earlier_hydra_record(argv, when) == argv  # a new directory: Hydra's own .hydra/
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("x")
    assert cli.keep_earlier_hydra_record(argv, when) == [*argv, "hydra.output_subdir=.hydra/2026-11-30_18-05-09"]
    # Sweeps, and Lightning's DDP children (they set hydra.output_subdir themselves), are left alone.
    assert cli.keep_earlier_hydra_record(["train.py", "-m", *argv[1:]], when) == ["train.py", "-m", *argv[1:]]
    child = [*argv, "hydra.output_subdir=null"]
    assert cli.keep_earlier_hydra_record(child, when) == child
