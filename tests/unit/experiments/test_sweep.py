"""The sweep summary shows each failed job's error, and a sweep in which no job succeeded exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.experiments.sweep import SweepSummary, no_job_succeeded, write_summary


def _job(sweep: Path, num: int, metrics: dict | None) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save([f"seed={num}"], job / ".hydra" / "overrides.yaml")
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))


def _end(sweep: Path) -> None:
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))


def test_the_summary_lists_the_error_of_each_job_that_has_one(tmp_path):
    _job(tmp_path, 0, {"status": "failed", "error": "RuntimeError: boom\n  on rank 1"})
    _job(tmp_path, 1, {"status": "refused", "error": "optimizer=adamw8bit_torchao needs the package 'torchao'"})
    _job(tmp_path, 2, {"status": "ok", "train_loss": 2.5})
    md = write_summary(tmp_path)[0].read_text()
    assert "3 job(s): 1 ok, 1 failed, 1 refused;" in md
    errors = md.split("Errors:", 1)[1]
    assert "- job 0 (failed): RuntimeError: boom on rank 1" in errors
    assert "- job 1 (refused): optimizer=adamw8bit_torchao needs the package 'torchao'" in errors
    assert "job 2" not in errors


def test_a_summary_without_errors_has_no_error_list(tmp_path):
    _job(tmp_path, 0, {"status": "ok"})
    assert "Errors:" not in write_summary(tmp_path)[0].read_text()


@pytest.mark.parametrize(
    ("statuses", "none_ok"),
    [
        (["refused", "refused"], True),
        (["failed", "oom", "diverged"], True),
        (["refused", "ok"], False),
        ([None, "ok"], False),  # None: no metrics.json
        ([None, None], False),  # plan.py -m: planned jobs write none, nothing to judge
        ([], False),
    ],
)
def test_no_job_succeeded(tmp_path, statuses, none_ok):
    rows = [{"job": str(i), "status": s or "missing"} for i, s in enumerate(statuses)]
    assert no_job_succeeded(rows) is none_ok


def test_the_sweep_exits_2_after_writing_its_summary_when_no_job_succeeded(tmp_path, capsys):
    _job(tmp_path, 0, {"status": "refused", "error": "a"})
    _job(tmp_path, 1, {"status": "failed", "error": "b"})
    with pytest.raises(SystemExit) as exit_:
        _end(tmp_path)
    assert exit_.value.code == 2
    assert (tmp_path / "sweep_summary.md").is_file()
    assert "error: no job of the sweep succeeded (job 0 refused, job 1 failed)" in capsys.readouterr().err


def test_one_good_job_makes_the_sweep_succeed(tmp_path):
    _job(tmp_path, 0, {"status": "refused", "error": "a"})
    _job(tmp_path, 1, {"status": "ok"})
    _end(tmp_path)
    assert (tmp_path / "sweep_summary.md").is_file()


def test_a_sweep_without_job_records_writes_no_summary(tmp_path):
    (tmp_path / "0").mkdir()  # what plan.py -m leaves (hydra.output_subdir=null)
    _end(tmp_path)
    assert not (tmp_path / "sweep_summary.md").exists()


def test_an_early_stopped_job_succeeded_and_a_guard_stopped_one_did_not():
    early = {"job": "0", "status": "stopped", "stopped_by": "EarlyStopping", "stopped_at_step": 40}
    guard = {"job": "1", "status": "stopped", "stopped_by": "NonFiniteGuard", "stopped_at_step": 7}
    assert no_job_succeeded([early]) is False
    assert no_job_succeeded([guard]) is True


def test_a_report_s_command_line_says_its_usage_and_rewrites_a_finished_sweep(tmp_path, capsys):
    from lightning_trainopt.experiments.parity import ParityReport

    assert ParityReport.main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().out.strip() == (
        "usage: python -m lightning_trainopt.experiments.parity SWEEP_DIR (the sweep directory of "
        "experiment=precision_parity)"
    )
    assert ParityReport.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "precision_parity.md").read_text() in out
    assert f"precision parity report: {tmp_path / 'precision_parity.md'}" in out
