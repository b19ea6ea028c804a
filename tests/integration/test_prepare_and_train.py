"""prepare.py then train.py, as a user types them: a BPE trained on standard-library files, and a model learning it."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

from lightning_trainopt.metrics.model_shape import GPTConfig
from tests.helpers.compose import REPO_ROOT
from tests.helpers.prepared import STDLIB, read_stream


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / script), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_prepare_then_train_on_the_shards(tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    prepared = _run(
        "prepare.py",
        f"input={STDLIB / 'json' / '*.py'}",
        f"output={data}",
        "tokenizer.vocab_size=512",
        "progress=false",
    )
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["vocab_size"] == 512
    assert manifest["tokens"] == len(read_stream(data))
    assert f"python train.py data=tokenized data.path={data}" in prepared.stdout

    _run(
        "train.py",
        "data=tokenized",
        f"data.path={data}",
        "trainer.max_steps=5",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.ffn_hidden=128",
        "data.seq_len=32",
        "data.batch_size=8",
        "optimizer.lr=0.01",
        "scheduler.warmup_steps=1",
        "trainer.val_check_interval=5",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "callbacks=none",
        f"hydra.run.dir={run_dir}",
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok"
    assert metrics["global_step"] == 5
    # The preset's byte-level vocabulary (256) gave way to the manifest's 512 (no model.vocab_size given).
    shape = {"n_layers": 2, "d_model": 64, "n_heads": 2, "ffn_hidden": 128}
    assert metrics["n_params"] == GPTConfig(vocab_size=512, **shape).n_params() > GPTConfig(**shape).n_params()
    assert metrics["seq_len"] == 32
    assert metrics["tokens_seen"] == 5 * 8 * 32
    rows = list(csv.DictReader((next(run_dir.rglob("metrics.csv"))).open()))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == 5
    # A model that has learnt nothing scores ln(512) = 6.24 nats; five steps on the BPE tokens already learn.
    assert losses[0] > 6.0
    assert losses[-1] < losses[0] - 0.2
    assert metrics["val_loss"] < math.log(512) - 0.3
