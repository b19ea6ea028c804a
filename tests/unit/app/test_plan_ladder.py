"""The ladder report from job directories laid out as a Hydra multirun leaves them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.app.ladder import LadderReport, collect_ladder, write_ladder_report
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
    from lightning_trainopt.app import ladder

    sweep = tmp_path / "sweep"
    _job(sweep, 0, "bf16", {"status": "ok"}, tmp_path)

    def broken(rows, sweep_dir):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ladder, "write_ladder_report", broken)
    with pytest.raises(SystemExit, match="ladder report not written .RuntimeError: disk full"):
        LadderReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
