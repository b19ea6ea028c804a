"""Memory techniques under DDP, DeepSpeed ZeRO-2/3 and FSDP2 on 2 CPU processes (gloo); each run is a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_trainopt.core.saved_tensors import SavedTensorsCounter
from lightning_trainopt.models.gpt import GPT
from tests.helpers.runif import RunIf

WORKER = Path(__file__).with_name("_memory_techniques_worker.py")
ROOT = WORKER.parents[2]


def _run(tmp: Path, strategy: str, technique: str, micro: int, accum: int, **env: str) -> dict[str, Any]:
    out = tmp / f"{strategy}_{technique}_{micro}_{accum}.json"
    subprocess.run(
        [sys.executable, str(WORKER), strategy, technique, str(micro), str(accum), str(out)],
        cwd=ROOT,
        env={**os.environ, **env},
        check=True,
        timeout=300,
        capture_output=True,
    )
    return json.loads(out.read_text())


def _single_device_bytes(micro: int) -> int:
    """Bytes saved for backward by the worker's model on one micro-batch, no technique (same on every strategy)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(worker)
    model = GPT(worker.CFG)
    x = torch.randint(0, 64, (micro, 32))
    with SavedTensorsCounter(params=model.parameters()) as counter:
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().view(-1, 64), x.reshape(-1))
    return counter.report().activation_bytes


def _close(a: dict[str, list[float]], b: dict[str, list[float]]) -> None:
    assert a.keys() == b.keys()
    assert a
    for name in a:
        torch.testing.assert_close(torch.tensor(a[name]), torch.tensor(b[name]), rtol=1e-4, atol=1e-5, msg=name)


CLIP, LR = 1e-3, 0.5  # the worker's SGD learning rate


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        pytest.param("zero1", marks=RunIf(deepspeed=True)),
        pytest.param("zero2", marks=RunIf(deepspeed=True)),
        pytest.param("zero3", marks=RunIf(deepspeed=True)),
        "fsdp2",
    ],
)
def test_checkpointing_cuts_saved_bytes_and_clipping_holds_under_strategy(tmp_path: Path, strategy: str) -> None:
    """One launch checks two things per strategy: checkpointing cuts the bytes saved for backward, and clipping by
    norm (``trainer.gradient_clip_val``; DeepSpeed clips inside its engine) bounds the update. With plain SGD the
    update of one step is ``lr x clip(grad)``. This model's first gradient norm is far above CLIP: 0.78, measured
    under zero2 without clipping (update norm 0.389). So a working clip makes the update norm ``lr x CLIP`` (torch
    and DeepSpeed divide by ``norm + 1e-6``: 0.1% here), and a missing one would make it ~780x larger."""
    result = _run(tmp_path, strategy, "checkpoint", 4, 1, CLIP=str(CLIP))
    baseline = _single_device_bytes(4)
    assert result["global_step"] == 1
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert 0 < result["first_bytes"] < 0.5 * baseline
    assert result["update_norm"] == pytest.approx(LR * CLIP, rel=0.01)


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_zero2_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    """Lightning divides the loss by the accumulation and DeepSpeed would divide it again (Lightning #6170):
    TrainOptDeepSpeedStrategy.backward passes scale_wrt_gas=False, so 4 x 1 equals 1 x 4."""
    big = _run(tmp_path, "zero2", "none", 4, 1)
    accumulated = _run(tmp_path, "zero2", "none", 1, 4)
    assert big["sizes"] == [4]
    assert accumulated["sizes"] == [1, 1, 1, 1]
    assert accumulated["engine_accumulate"] == 4
    _close(big["params"], accumulated["params"])


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_micro_batch_finder_under_zero2_matches_the_manual_config(tmp_path: Path) -> None:
    """The finder turns (micro 4, accum 1) into (micro 2, accum 2) inside a running DeepSpeed engine: the update
    must equal the one of a run configured with micro 2 x accum 2 from the start."""
    found = _run(tmp_path, "zero2", "finder", 4, 1, FINDER_MAX_MICRO="2")
    manual = _run(tmp_path, "zero2", "none", 2, 2)
    assert found["sizes"] == [2, 2]
    assert found["accumulate"] == [2, 2]
    assert (
        (found["engine_micro"], found["engine_accumulate"])
        == (2, 2)
        == (manual["engine_micro"], manual["engine_accumulate"])
    )
    _close(manual["params"], found["params"])
