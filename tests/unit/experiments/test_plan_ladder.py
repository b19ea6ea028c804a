"""The ladder report from job directories laid out as a Hydra multirun leaves them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.experiments.ladder import LadderReport, collect_ladder, write_ladder_report
from lightning_trainopt.experiments.sweep import write_summary
from tests.helpers.compose import compose_config


def _job(sweep: Path, num: int, rung: str, metrics: dict | None, tmp_path: Path) -> None:
    cfg = compose_config([f"+experiment/ladder_rung={rung}", "model=gpt_tiny", "trainer=ddp_sim"], tmp_path)
    job = sweep / str(num) / ".hydra"
    job.mkdir(parents=True)
    hydra = cfg.hydra
    OmegaConf.save({"hydra": {"runtime": {"choices": dict(hydra.runtime.choices)}}}, job / "hydra.yaml")
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra")
    OmegaConf.save(plain, job / "config.yaml")
    if metrics is not None:
        (sweep / str(num) / "metrics.json").write_text(json.dumps(metrics))


def test_report_has_a_row_per_job_with_predictions_and_oom(tmp_path):
    sweep = tmp_path / "sweep"
    breakdown = {c: {"device": 1000, "cpu": 0} for c in ("params", "grads", "optimizer_states")}
    _job(
        sweep,
        0,
        "fp32",
        {
            "status": "ok",
            "peak_memory_bytes": 50_000_000,
            "tokens_per_sec": 4000.0,
            "world_size": 2,
            "memory_breakdown": breakdown,
        },
        tmp_path,
    )
    _job(sweep, 1, "zero1", {"status": "oom"}, tmp_path)
    _job(sweep, 2, "zero2", None, tmp_path)
    rows = collect_ladder(sweep)
    assert [(r.rung, r.status) for r in rows] == [("fp32", "ok"), ("zero1", "oom"), ("zero2", "failed")]
    assert rows[0].tokens_per_sec == 2000.0
    assert rows[0].model_states_bytes == 3000
    assert all(r.predicted_peak_bytes and r.predicted_peak_bytes > 0 for r in rows)
    # ZeRO-1 partitions the optimizer states the fp32 DDP rung holds whole.
    assert rows[1].predicted_model_states_bytes < rows[0].predicted_model_states_bytes
    paths = write_ladder_report(rows, sweep)
    with paths["csv"].open() as f:
        assert [r["rung"] for r in csv.DictReader(f)] == ["fp32", "zero1", "zero2"]
    md = paths["md"].read_text()
    assert "| 1 | zero1 | oom |" in md
    assert paths["png"].stat().st_size > 1000


def test_callback_writes_into_the_sweep_dir(tmp_path):
    sweep = tmp_path / "sweep"
    _job(sweep, 0, "bf16", {"status": "ok"}, tmp_path)
    LadderReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "ladder.md").is_file()
    assert (sweep / "ladder.png").is_file()


def test_a_report_that_cannot_be_written_fails_the_sweep(tmp_path, monkeypatch):
    # Hydra turns an Exception from a callback into a warning and exits 0; the ladder must not pass without its report.
    from lightning_trainopt.experiments import ladder

    sweep = tmp_path / "sweep"
    _job(sweep, 0, "bf16", {"status": "ok"}, tmp_path)

    def broken(rows, sweep_dir):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ladder, "write_ladder_report", broken)
    with pytest.raises(SystemExit, match="ladder report not written .RuntimeError: disk full"):
        LadderReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))


def test_a_diverged_or_stopped_rung_is_not_shown_as_a_success(tmp_path):
    sweep = tmp_path / "sweep"
    _job(sweep, 0, "fp32", {"status": "ok", "tokens_per_sec": 4000.0}, tmp_path)
    _job(sweep, 1, "bf16", {"status": "diverged", "train_loss": None, "tokens_per_sec": 5000.0}, tmp_path)
    stopped = {"status": "stopped", "stopped_by": "NonFiniteGuard", "stopped_at_step": 4}
    _job(sweep, 2, "zero1", stopped, tmp_path)
    rows = collect_ladder(sweep)
    assert [(r.rung, r.status) for r in rows] == [("fp32", "ok"), ("bf16", "diverged"), ("zero1", "stopped")]
    assert (rows[2].stopped_by, rows[2].stopped_at_step) == ("NonFiniteGuard", 4)
    md = write_ladder_report(rows, sweep)["md"].read_text()
    assert "| 1 | bf16 | diverged |" in md
    assert "| 2 | zero1 | stopped (NonFiniteGuard at step 4) |" in md
    assert md.rstrip().endswith("Not a success: bf16 (diverged), zero1 (stopped (NonFiniteGuard at step 4)).")


def _sweep_job(sweep: Path, num: int, overrides: list[str], metrics: dict | None) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(overrides, job / ".hydra" / "overrides.yaml")
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))


def test_sweep_summary_shows_each_jobs_status_and_counts_them(tmp_path):
    # The summary of any `-m` sweep (experiments/sweep.py), from the same kind of job directories.
    sweep = tmp_path / "sweep"
    _sweep_job(sweep, 0, ["optimizer.lr=3e-4"], {"status": "ok", "train_loss": 2.5})
    _sweep_job(sweep, 1, ["optimizer.lr=1e6"], {"status": "diverged", "train_loss": None})
    guard = {"status": "stopped", "stopped_by": "NonFiniteGuard", "stopped_at_step": 4, "train_loss": 5.5}
    _sweep_job(sweep, 2, ["optimizer.lr=1e5"], guard)
    _sweep_job(sweep, 3, ["optimizer.lr=-1"], {"status": "refused", "error": "optimizer.lr=-1 is invalid"})
    md_path, csv_path = write_summary(sweep)
    md = md_path.read_text()
    assert "| 1 | optimizer.lr=1e6 | diverged |" in md
    assert "| 2 | optimizer.lr=1e5 | stopped (NonFiniteGuard at step 4) |" in md
    assert "4 job(s): 1 ok, 1 diverged, 1 refused, 1 stopped;" in md
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "diverged", "stopped", "refused"]
    assert rows[2]["stopped_by"] == "NonFiniteGuard"
    assert rows[2]["stopped_at_step"] == "4"
