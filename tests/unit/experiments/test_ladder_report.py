"""What the ladder report shows: metrics.json's nested figures, why a figure is missing, predicted rows, the plot."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.config.plan import plan
from lightning_trainopt.exceptions import install_command
from lightning_trainopt.experiments import ladder
from lightning_trainopt.experiments.ladder import (
    LadderReport,
    collect_ladder,
    ladder_figure,
    ladder_rungs,
    plot_series,
    predicted_row,
    write_ladder_report,
)
from tests.helpers.compose import REPO_ROOT, compose_config

STATES = {c: {"device": 4_000_000, "cpu": 0, "nvme": 0} for c in ("params", "grads", "optimizer_states")}
CPU_PEAK = "unknown: set +hardware.peak_tflops.<dtype>=<TFLOP/s> for MFU on CPU"
NO_PRICE = "no default price: set hardware.price_per_device_hour"


def _metrics(tokens_per_s: float, dtype: str = "fp32", **over) -> dict:
    """A metrics.json as train.py writes it on CPU: the callbacks' summaries are nested."""
    m = {
        "status": "ok",
        "world_size": 2,
        "tokens_per_sec": 2 * tokens_per_s,
        "peak_memory_bytes": None,
        "memory_breakdown": {**STATES, "activations": 9_000_000, "source": "tensor accounting (CPU: no allocator)"},
        "throughput": {
            "dtype": dtype,
            "hardware": "cpu",
            "peak_tflops": None,
            "peak_source": CPU_PEAK,
            "tokens_per_s": tokens_per_s,
            "tflops_per_s": tokens_per_s * 5.8e6 / 1e12,
            "mfu": None,
        },
        "cost": {"dollars_per_1b_tokens": None, "price_source": NO_PRICE, "price_per_device_hour": None},
    }
    for key, value in over.items():
        if isinstance(value, dict):
            m[key] = {**m[key], **value}
        else:
            m[key] = value
    return m


def _job(sweep: Path, num: int, rung: str, metrics: dict | None, tmp_path: Path, extra: tuple[str, ...] = ()) -> None:
    """A job directory as Hydra's multirun leaves it (config, runtime choices, metrics.json)."""
    overrides = [f"+experiment/ladder_rung={rung}", "model=gpt_tiny", "trainer=ddp_sim", "hardware=cpu", *extra]
    cfg = compose_config(overrides, tmp_path)
    job = sweep / str(num) / ".hydra"
    job.mkdir(parents=True)
    OmegaConf.save({"hydra": {"runtime": {"choices": dict(cfg.hydra.runtime.choices)}}}, job / "hydra.yaml")
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra")
    OmegaConf.save(plain, job / "config.yaml")
    if metrics is not None:
        (sweep / str(num) / "metrics.json").write_text(json.dumps(metrics))


@pytest.fixture(scope="module")
def cpu_sweep(tmp_path_factory) -> Path:
    """fp32, bf16 and bf16_ckpt on CPU hardware (no peak FLOP/s, no price), and a rung that ran out of memory."""
    tmp = tmp_path_factory.mktemp("ladder")
    sweep = tmp / "sweep"
    _job(sweep, 0, "fp32", _metrics(1000.0), tmp)
    _job(sweep, 1, "bf16", _metrics(500.0, "bf16"), tmp)
    _job(sweep, 2, "bf16_ckpt", _metrics(400.0, "bf16"), tmp)
    _job(sweep, 3, "zero2", {"status": "oom"}, tmp)
    return sweep


def _table(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| ")]


def test_tflops_mfu_and_dollars_are_read_from_the_nested_summaries(tmp_path):
    sweep = tmp_path / "sweep"
    gpu_like = _metrics(
        3000.0,
        peak_memory_bytes=60_000_000,
        throughput={"tflops_per_s": 12.5, "mfu": 0.41, "peak_tflops": 30.0},
        cost={"dollars_per_1b_tokens": 87.5, "price_per_device_hour": 2.0, "price_source": "user-set"},
    )
    _job(sweep, 0, "fp32", gpu_like, tmp_path, ("hardware.price_per_device_hour=2.0",))
    (row,) = collect_ladder(sweep)
    assert (row.tflops_per_device, row.mfu, row.usd_per_1b_tokens) == (12.5, 0.41, 87.5)
    assert row.tokens_per_sec == 3000.0  # throughput.tokens_per_s: per device, warm-up excluded
    md = write_ladder_report([row], tmp_path)["md"].read_text()
    header, cells = _table(md)
    by_name = dict(zip(header, cells))
    assert by_name["TFLOP/s/dev"] == "12.5"
    assert by_name["MFU"] == "0.41"
    assert by_name["$/1B tok (pred)"].startswith("87.5 (")
    assert "n/a" not in by_name["$/1B tok (pred)"]  # a price: the planner's dollars are there too


def test_a_figure_cpu_cannot_give_says_why_and_how_to_get_it(cpu_sweep):
    rows = collect_ladder(cpu_sweep)
    md = write_ladder_report(rows, cpu_sweep)["md"].read_text()
    header, *body = _table(md)
    fp32 = dict(zip(header, body[0]))
    assert fp32["TFLOP/s/dev"] == "0.0058"
    notes = {line.split("] ", 1)[0] + "]": line.split("] ", 1)[1] for line in md.splitlines() if line[:1] == "["}
    mfu_note = notes[fp32["MFU"].removeprefix("n/a ")]
    assert "fp32 peak FLOP/s for cpu" in mfu_note
    assert "+hardware.peak_tflops" in mfu_note
    usd_note = notes[fp32["$/1B tok (pred)"].split(" (")[0].removeprefix("n/a ")]
    assert "hardware.price_per_device_hour" in usd_note
    assert "no allocator peak" in notes[fp32["peak MiB (pred)"].split(" (")[0].removeprefix("n/a ")]
    # The OOM rung did not train: no reasons for its empty cells, its status says it.
    zero2 = dict(zip(header, body[3]))
    assert (zero2["status"], zero2["TFLOP/s/dev"], zero2["MFU"]) == ("oom", "-", "-")
    assert md.rstrip().endswith("Not a success: zero2 (oom).")


def test_without_a_peak_each_dtype_is_calibrated_on_its_first_ok_rung(cpu_sweep):
    fp32, bf16, ckpt, oom = collect_ladder(cpu_sweep)
    assert (fp32.speed_source, bf16.speed_source) == ("calibration (fp32)", "calibration (bf16)")
    assert fp32.predicted_tokens_per_sec == pytest.approx(1000.0)
    assert bf16.predicted_tokens_per_sec == pytest.approx(500.0)
    # bf16_ckpt recomputes the forward: the bf16 rate over its larger FLOPs per token, not its own measurement.
    assert ckpt.speed_source == "calibrated on bf16"
    assert ckpt.train_flops_per_token > bf16.train_flops_per_token
    expected = 500.0 * bf16.train_flops_per_token / ckpt.train_flops_per_token
    assert ckpt.predicted_tokens_per_sec == pytest.approx(expected)
    assert oom.predicted_tokens_per_sec == pytest.approx(500.0 * bf16.train_flops_per_token / oom.train_flops_per_token)
    md = write_ladder_report([fp32, bf16, ckpt, oom], cpu_sweep)["md"].read_text()
    assert "| 0 | fp32 | ok |" in md
    assert "| calibration |" in md
    assert "the first ok rung of each dtype is its calibration" in md


def test_both_panels_plot_measured_beside_predicted(cpu_sweep):
    rows = collect_ladder(cpu_sweep)
    data = plot_series(rows)
    # CPU: no allocator peak, so the memory panel compares what both sides count (states + activations).
    assert data["memory"]["ylabel"].startswith("model states + activations")
    fig = ladder_figure(rows)
    memory_ax, speed_ax = fig.axes
    for ax, panel in ((memory_ax, "memory"), (speed_ax, "throughput")):
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert [label.split(" ")[0] for label in labels] == ["measured", "planner"], labels
        assert list(data[panel]["series"]) == labels
        for container, values in zip(ax.containers, data[panel]["series"].values()):
            heights = [bar.get_height() for bar in container]
            # the three rungs that trained have bars on both sides; the OOM rung has none measured
            assert all(h > 0 for h in heights[:3]), (panel, heights)
            assert heights[:3] == pytest.approx(values[:3])


def test_predicted_rows_show_whether_each_rung_fits_and_are_no_failures(tmp_path):
    rows = []
    over = ["model=llama_7b", "hardware=a100_80gb", "trainer.devices=4", "data.seq_len=4096", "data.batch_size=1"]
    for i, rung in enumerate(["bf16_ckpt", "zero2"]):
        cfg = compose_config([*over, f"+experiment/ladder_rung={rung}"], name="plan")
        rows.append(predicted_row(i, rung, plan(cfg)))
    assert [r.predicted_fits for r in rows] == [False, True]
    md = write_ladder_report(rows, tmp_path)["md"].read_text()
    assert md.startswith("# Optimization ladder: predicted")
    assert "Not a success" not in md
    header, ckpt, zero2 = _table(md)
    assert header[:4] == ["#", "rung", "fits", "margin GiB"]
    assert (ckpt[2], zero2[2]) == ("no", "yes")
    assert float(ckpt[3].replace(",", "")) < 0 < float(zero2[3].replace(",", ""))
    memory = plot_series(rows)["memory"]
    assert list(memory["series"]) == ["planner (predicted)"]
    ckpt_peak, zero2_peak = memory["series"]["planner (predicted)"]
    assert ckpt_peak > memory["limit"] > zero2_peak  # the line `fits` compares with: device memory less headroom


def test_without_matplotlib_the_table_and_csv_are_written_with_the_hint(cpu_sweep, tmp_path, monkeypatch, capsys):
    rows = collect_ladder(cpu_sweep)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    paths = write_ladder_report(rows, tmp_path)
    assert "png" not in paths
    assert not (tmp_path / "ladder.png").exists()
    with paths["csv"].open() as f:
        assert [r["rung"] for r in csv.DictReader(f)] == ["fp32", "bf16", "bf16_ckpt", "zero2"]
    md = paths["md"].read_text()
    assert "| 0 | fp32 | ok |" in md
    assert install_command("plot") in md  # the installed torch pinned, so pip keeps the build
    assert install_command("plot").startswith("pip install torch==")
    assert f"python -m lightning_trainopt.experiments.ladder {tmp_path}" in md
    # The sweep's callback does not fail: the report is there, and it says how to get the plot.
    monkeypatch.setattr(ladder, "collect_ladder", lambda sweep_dir: rows)
    LadderReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert install_command("plot") in capsys.readouterr().out


def test_the_rungs_are_the_experiments_sweep():
    assert ladder_rungs(REPO_ROOT / "lightning_trainopt" / "conf") == [
        "fp32",
        "bf16",
        "bf16_ckpt",
        "zero1",
        "zero2",
        "adamw8bit",
        "zero2_offload",
    ]


def test_a_job_that_did_not_train_shows_its_error_once(tmp_path):
    sweep = tmp_path / "sweep"
    error = "optimizer.lr=-1 is invalid: use a positive learning rate, e.g. 3e-4.\nsecond line"
    _job(sweep, 0, "fp32", {"status": "refused", "error": error}, tmp_path)
    md = write_ladder_report(collect_ladder(sweep), tmp_path)["md"].read_text()
    (row,) = [line for line in md.splitlines() if line.startswith("| 0 |")]
    ref = row.split("|")[3].strip().removeprefix("refused ")
    assert f"{ref} optimizer.lr=-1 is invalid: use a positive learning rate, e.g. 3e-4." in md.splitlines()
    assert md.rstrip().endswith("Not a success: fp32 (refused).")
