"""loss=chunked_ce under ZeRO-3 and FSDP2 on 2 CPU processes trains as the standard loss does (the head's weight is
gathered for the chunked head in forward and backward), and loss=liger is refused on a CPU before training.

Each case is one sweep of two jobs with the same strategy: the second ZeRO-3 job of a sweep used to fail (rank 0
carried DeepSpeed's module counter over from the first job; ``parallel.deepspeed.reset_zero3_counters``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.compose import REPO_ROOT

TINY = (
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.ffn_hidden=128",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.max_bytes=200000",
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
    "logger=none",
)


def _train(*args: str, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_the_chunked_loss_trains_as_the_standard_loss_under_sharding(tmp_path, strategy):
    pytest.importorskip("deepspeed")
    proc = _train(
        "-m", "trainer=ddp_sim", f"+strategy={strategy}", "loss=standard,chunked_ce",
        *TINY, f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    runs = {}
    for path in tmp_path.glob("*/metrics.json"):
        overrides = (path.parent / ".hydra" / "overrides.yaml").read_text()
        runs["chunked_ce" if "loss=chunked_ce" in overrides else "standard"] = json.loads(path.read_text())
    assert set(runs) == {"standard", "chunked_ce"}, proc.stderr[-3000:]
    assert all(m["status"] == "ok" and m["world_size"] == 2 for m in runs.values())
    for key in ("train_loss", "val_loss"):
        assert runs["chunked_ce"][key] == pytest.approx(runs["standard"][key], rel=1e-4), key


def test_liger_is_refused_on_a_cpu_before_training(tmp_path):
    proc = _train("loss=liger", "trainer.accelerator=cpu", *TINY, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: loss='liger' is invalid")
    assert "use loss=chunked_ce" in proc.stderr
    assert not (tmp_path / "metrics.json").exists()
