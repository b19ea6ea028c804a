"""The notebook runs top to bottom (so it cannot rot), and a two-rung ladder multirun writes its report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_plan_and_ladder_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "plan_and_ladder.ipynb", as_version=4)
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
        line for line in (ROOT / "conf/experiment/ladder.yaml").read_text().splitlines() if "ladder_rung:" in line
    )
    rungs = sweep.split(":", 1)[1].strip().split(",")
    assert len(rungs) == 7
    md = (out / "ladder.md").read_text()
    assert [f"| {i} | {rung} |" in md for i, rung in enumerate(rungs)] == [True] * len(rungs)


@pytest.mark.slow
def test_two_rung_ladder_writes_report_with_measured_and_predicted(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "experiment=ladder",
        f"hydra.sweep.dir={sweep}",
        "+experiment/ladder_rung=fp32,bf16",
        "trainer=default",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "trainer.max_steps=3",
        "scheduler.warmup_steps=1",
        "data.seq_len=32",
        "data.batch_size=2",
        "model.n_layers=2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (sweep / "ladder.md").read_text()
    assert "| 0 | fp32 |" in md
    assert "| 1 | bf16 |" in md
    assert (sweep / "ladder.csv").is_file()
    assert (sweep / "ladder.png").stat().st_size > 1000
