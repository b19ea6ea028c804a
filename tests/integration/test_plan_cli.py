"""`python plan.py ...` end to end: JSON on stdout, and a refused config exits 2 with one line naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "plan.py", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_plan_py_prints_json_for_8_devices_without_them():
    proc = _run(
        "model=llama_13b",
        "hardware=h100",
        "trainer.devices=8",
        "+strategy=zero3",
        "precision=bf16",
        "activations=checkpoint",
        "data.seq_len=4096",
        "data.batch_size=1",
        "plan.format=json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["world_size"] == 8
    assert out["n_params"] == 13_015_864_320
    assert out["fits"] is True
    assert out["usd_per_1b_tokens"] > 0


def test_plan_py_refuses_bad_input_with_the_key():
    proc = _run("trainer.devices=-1")
    assert proc.returncode == 2
    assert "trainer.devices=-1 is invalid" in proc.stderr
