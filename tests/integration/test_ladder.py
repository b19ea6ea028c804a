"""The notebook runs top to bottom (so it cannot rot) and is committed with the outputs of the current code; a short
ladder multirun writes a report whose columns and plot panels hold measured and predicted figures."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "plan_and_ladder.ipynb"
SAVE_HINT = (
    "re-execute and save it from notebooks/: python -c \"import nbformat, nbclient; p='plan_and_ladder.ipynb'; "
    'nb=nbformat.read(p, 4); nbclient.NotebookClient(nb, timeout=300).execute(); nbformat.write(nb, p)"'
)


def _ladder_table(nb) -> list[str]:
    """The rows of the predicted ladder table printed by the notebook's last cell."""
    text = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []))
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_plan_and_ladder_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("outputs") for c in code), f"the notebook is committed without its outputs: {SAVE_HINT}"
    committed = _ladder_table(nb)
    os.environ["TRAINOPT_ROOT"] = str(ROOT)  # restored by the autouse fixture
    os.environ.pop("LADDER_OUT", None)  # as a user runs it: the predicted report must not land in the working dir
    os.environ.pop("LADDER_DIR", None)
    os.environ["TMPDIR"] = str(tmp_path / "tmp")  # the kernel's tempfile.mkdtemp lands here, cleaned with tmp_path
    (tmp_path / "tmp").mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "python train.py model=llama_7b" in outputs
    assert list(cwd.iterdir()) == []
    (out,) = (tmp_path / "tmp").glob("ladder_predicted_*")
    assert f"report: {out}" in outputs
    assert (out / "ladder.png").stat().st_size > 1000
    # The predicted ladder has the experiment's rungs, in its sweep order.
    sweep = next(
        line
        for line in (ROOT / "lightning_trainopt/conf/experiment/ladder.yaml").read_text().splitlines()
        if "ladder_rung:" in line
    )
    rungs = sweep.split(":", 1)[1].strip().split(",")
    assert len(rungs) == 7
    md = (out / "ladder.md").read_text()
    assert [f"| {i} | {rung} |" in md for i, rung in enumerate(rungs)] == [True] * len(rungs)
    # Predictions, labelled as such, each saying whether it fits; none of them is a run that failed.
    assert md.startswith("# Optimization ladder: predicted")
    assert "Not a success" not in md
    fits = {
        line.split("|")[2].strip(): line.split("|")[3].strip()
        for line in md.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    }
    assert set(fits) == set(rungs)
    assert set(fits.values()) == {"yes", "no"}, fits  # LLaMA-7B on 4x A100-80GB: ZeRO fits, plain DDP does not
    assert fits["zero2"] == "yes"
    assert fits["fp32"] == "no"
    # The committed outputs are those of the current code.
    assert committed == _ladder_table(nb), f"the notebook's committed outputs are stale: {SAVE_HINT}"


@pytest.fixture(scope="module")
def short_ladder(tmp_path_factory) -> Path:
    """Three rungs (fp32, bf16 + checkpointing, ZeRO-2) of 4 steps on one CPU process, with a price and an fp32 peak."""
    sweep = tmp_path_factory.mktemp("ladder") / "sweep"
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "experiment=ladder",
        f"hydra.sweep.dir={sweep}",
        "+experiment/ladder_rung=fp32,bf16_ckpt,zero2",
        "trainer=default",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "trainer.max_steps=4",
        "scheduler.warmup_steps=1",
        "data.seq_len=32",
        "data.batch_size=2",
        "model.n_layers=2",
        "callbacks.model_checkpoint=null",
        "hardware=cpu",
        "hardware.price_per_device_hour=0.5",
        "+hardware.peak_tflops.fp32=0.5",  # an fp32 peak only: the bf16 rungs show why they have no MFU
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


@pytest.mark.slow
def test_short_ladder_fills_every_column_it_can_and_says_why_not(short_ladder):
    md = (short_ladder / "ladder.md").read_text()
    for i, rung in enumerate(["fp32", "bf16_ckpt", "zero2"]):
        assert f"| {i} | {rung} | ok |" in md
    with (short_ladder / "ladder.csv").open() as f:
        rows = {r["rung"]: r for r in csv.DictReader(f)}
    for rung, r in rows.items():
        for key in (
            "model_states_bytes",
            "predicted_model_states_bytes",
            "activations_bytes",
            "predicted_activations_bytes",
            "tokens_per_sec",
            "predicted_tokens_per_sec",
            "tflops_per_device",
            "usd_per_1b_tokens",
            "predicted_usd_per_1b_tokens",
        ):
            assert float(r[key]) > 0, (rung, key, r[key])
    # MFU where a peak exists (fp32, from the planner's peak too); the bf16 rungs say which peak is missing.
    assert 0 < float(rows["fp32"]["mfu"]) < 1
    assert rows["fp32"]["speed_source"].startswith("planner")
    assert rows["bf16_ckpt"]["mfu"] == ""
    assert "no bf16 peak FLOP/s for cpu" in rows["bf16_ckpt"]["why_no_mfu"]
    assert "no bf16 peak FLOP/s for cpu" in md
    # No bf16 peak: bf16_ckpt calibrates the bf16 rate and ZeRO-2 is predicted from it.
    assert rows["bf16_ckpt"]["speed_source"] == "calibration (bf16)"
    assert rows["zero2"]["speed_source"] == "calibrated on bf16_ckpt"
    # The ZeRO-2 buckets are sized to the model, so they do not dwarf it in the predicted peak.
    assert float(rows["zero2"]["predicted_peak_bytes"]) < 2 * float(rows["bf16_ckpt"]["predicted_peak_bytes"])


@pytest.mark.slow
def test_short_ladder_plot_has_measured_and_predicted_in_both_panels(short_ladder):
    from lightning_trainopt.experiments.ladder import collect_ladder, ladder_figure

    assert (short_ladder / "ladder.png").stat().st_size > 1000
    fig = ladder_figure(collect_ladder(short_ladder))
    for ax in fig.axes:
        labels = [t.get_text().split(" ")[0] for t in ax.get_legend().get_texts()]
        assert labels == ["measured", "planner"], (ax.get_title(), labels)
        for container in ax.containers:
            assert all(bar.get_height() > 0 for bar in container), ax.get_title()
