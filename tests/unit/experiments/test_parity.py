"""The precision parity report reads each job's logged losses and measures them against the fp32 run."""

from __future__ import annotations

import csv
import json

import pytest

from lightning_trainopt.experiments.parity import ParityRun, collect_parity, deviation, write_parity_report


def _job(sweep, num, precision, losses, status="ok", versions=1, layers=None):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- precision={precision}\n")
    metrics = {"precision": precision, "status": status, "precision_layers": layers}
    (job / "metrics.json").write_text(json.dumps(metrics))
    steps = sorted(losses)
    # A resumed run writes a second log version; its steps continue the first's.
    for v, part in enumerate([steps[: len(steps) // versions], steps[len(steps) // versions :]][:versions]):
        log = job / "logs" / f"version_{v}"
        log.mkdir(parents=True)
        with (log / "metrics.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["epoch", "step", "train_loss", "val_loss"])
            for s in part:
                w.writerow([0, s, losses[s], ""])
                w.writerow([0, s, "", 9.9])  # a validation row: no train_loss


def test_deviation_is_measured_over_the_common_steps():
    base = ParityRun("0", "fp32", "ok", {0: 5.0, 1: 4.0, 2: 3.0, 3: 2.0})
    run = ParityRun("1", "bf16", "ok", {0: 5.0, 1: 4.5, 2: 3.1})
    d = deviation(run, base)
    assert d == {
        "steps": 3,
        "max_abs": 0.5,
        "max_step": 1,
        "final_abs": pytest.approx(0.1),
        "final_rel": pytest.approx(0.1 / 3),
    }
    assert deviation(ParityRun("2", "fp8", "refused"), base)["max_abs"] is None


def test_the_report_reads_the_sweep_and_writes_md_csv_and_png(tmp_path):
    layers = {"fp8_layers": 4, "bf16_layers": 1, "emulated": True, "fp8_weight_fraction": 0.8}
    _job(tmp_path, 0, "fp32", {0: 5.0, 1: 4.0, 2: 3.0})
    _job(tmp_path, 1, "bf16", {0: 5.0, 1: 4.25, 2: 3.5}, versions=2)
    _job(tmp_path, 2, "fp8", {0: 5.0, 1: 4.0, 2: 3.25}, layers=layers)
    _job(tmp_path, 3, "fp8_te", {}, status="refused")
    runs = collect_parity(tmp_path)
    summary = [(r.precision, r.status, len(r.losses)) for r in runs]
    assert summary == [("fp32", "ok", 3), ("bf16", "ok", 3), ("fp8", "ok", 3), ("fp8_te", "refused", 0)]
    paths = write_parity_report(runs, tmp_path)
    md = paths["md"].read_text()
    assert "| fp32 | ok | 3 | 3.0000 | baseline |" in md
    assert "| bf16 | ok | 3 | 3.5000 | 0.5000 (2) | 0.5000 | 16.67% |  |" in md
    fp8_row = "| fp8 | ok | 3 | 3.2500 | 0.2500 (2) | 0.2500 | 8.33% | 4 of 5 linear layers, 80% of their weights"
    assert f"{fp8_row} (emulated) |" in md
    assert "No training loss was logged for fp8_te" in md
    rows = list(csv.reader(paths["csv"].open()))
    assert rows[0] == ["step", "fp32", "bf16", "fp8", "fp8_te"]
    assert rows[2] == ["1", "4.0", "4.25", "4.0", ""]
    pytest.importorskip("matplotlib")
    assert paths["png"].stat().st_size > 10_000


def test_an_fp8_run_that_converted_nothing_is_called_out(tmp_path):
    _job(tmp_path, 0, "fp32", {0: 5.0})
    _job(tmp_path, 1, "fp8", {0: 5.0}, layers={"fp8_layers": 0, "bf16_layers": 29, "fp8_weight_fraction": 0.0})
    md = write_parity_report(collect_parity(tmp_path), tmp_path)["md"].read_text()
    assert "| 0 of 29 linear layers, 0% of their weights |" in md
    assert "An FP8 run converted no layer: it trained in bf16" in md


def test_without_an_fp32_run_the_report_says_to_add_the_baseline(tmp_path):
    _job(tmp_path, 0, "bf16", {0: 5.0})
    md = write_parity_report(collect_parity(tmp_path), tmp_path)["md"].read_text()
    assert "include precision=fp32 in the sweep as the baseline" in md
