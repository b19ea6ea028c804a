"""Memory techniques under DDP, DeepSpeed ZeRO-1/2/3 and FSDP2 on 2 CPU processes (gloo).

Every case is fitted in one launch of ``_memory_techniques_worker.py`` (a module-scoped fixture): the fits run one
after another in one pair of processes, each from the same seed, so pytest itself never joins a process group and the
module pays for one process start-up instead of nine.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter
from lightning_trainopt.models.gpt import GPT
from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

WORKER = Path(__file__).with_name("_memory_techniques_worker.py")
ROOT = WORKER.parents[2]
CLIP, LR = 1e-3, 0.5  # the worker's SGD learning rate
# The worker's cases (STRATEGY:TECHNIQUE:MICRO:ACCUM[:options], see its docstring), by what the tests call them.
CHECKPOINTED = {s: f"{s}:checkpoint:4:1:clip={CLIP}" for s in ("ddp", "zero1", "zero2", "zero3", "fsdp2")}
ZERO2 = {
    "big": "zero2:none:4:1",
    "accumulated": "zero2:none:1:4",
    "found": "zero2:finder:4:1:max_micro=2",
    "manual": "zero2:none:2:2",
}
Runs = tuple[dict[str, Any], int, str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every case of this module fitted in one launch of the worker (one pair of processes, one start-up).

    The DeepSpeed cases are left out where DeepSpeed is not installed (their tests skip). Returns the results by case
    and the launch's exit code and stderr: a launch that failed fails every test of the module with that stderr.
    """
    cases = [CHECKPOINTED["ddp"]]
    if HAS_DEEPSPEED:
        cases += [CHECKPOINTED["zero1"], CHECKPOINTED["zero2"], CHECKPOINTED["zero3"], *ZERO2.values()]
    cases.append(CHECKPOINTED["fsdp2"])  # last, as bench/strategies.py fits FSDP2 after the DeepSpeed presets
    out = tmp_path_factory.mktemp("memory_techniques") / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), *cases],
        cwd=ROOT,
        env=child_env(ROOT),
        timeout=1200,
        capture_output=True,
        text=True,
    )
    results = json.loads(out.read_text()) if out.exists() else {}
    return results, proc.returncode, proc.stderr[-4000:]


def _result(runs: Runs, case: str) -> dict[str, Any]:
    results, code, stderr = runs
    assert code == 0, stderr
    assert case in results, stderr
    return results[case]


def _single_device_bytes(micro: int) -> int:
    """Bytes saved for backward by the worker's model on one micro-batch, no technique (same on every strategy)."""
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
def test_checkpointing_cuts_saved_bytes_and_clipping_holds_under_strategy(runs: Runs, strategy: str) -> None:
    """One fit checks two things per strategy: checkpointing cuts the bytes saved for backward, and clipping by
    norm (``trainer.gradient_clip_val``; DeepSpeed clips inside its engine) bounds the update. With plain SGD the
    update of one step is ``lr x clip(grad)``. This model's first gradient norm is far above CLIP: 0.78, measured
    under zero2 without clipping (update norm 0.389). So a working clip makes the update norm ``lr x CLIP`` (torch
    and DeepSpeed divide by ``norm + 1e-6``: 0.1% here), and a missing one would make it ~780x larger."""
    result = _result(runs, CHECKPOINTED[strategy])
    baseline = _single_device_bytes(4)
    assert result["global_step"] == 1
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert 0 < result["first_bytes"] < 0.5 * baseline
    assert result["update_norm"] == pytest.approx(LR * CLIP, rel=0.01)


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_zero2_accumulation_equals_one_big_batch(runs: Runs) -> None:
    """Lightning divides the loss by the accumulation and DeepSpeed would divide it again (Lightning #6170):
    TrainOptDeepSpeedStrategy.backward passes scale_wrt_gas=False, so 4 x 1 equals 1 x 4."""
    big = _result(runs, ZERO2["big"])
    accumulated = _result(runs, ZERO2["accumulated"])
    assert big["sizes"] == [4]
    assert accumulated["sizes"] == [1, 1, 1, 1]
    assert accumulated["engine_accumulate"] == 4
    _close(big["params"], accumulated["params"])


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_micro_batch_finder_under_zero2_matches_the_manual_config(runs: Runs) -> None:
    """The finder turns (micro 4, accum 1) into (micro 2, accum 2) inside a running DeepSpeed engine: the update
    must equal the one of a run configured with micro 2 x accum 2 from the start."""
    found = _result(runs, ZERO2["found"])
    manual = _result(runs, ZERO2["manual"])
    assert found["sizes"] == [2, 2]
    assert found["accumulate"] == [2, 2]
    assert (
        (found["engine_micro"], found["engine_accumulate"])
        == (2, 2)
        == (manual["engine_micro"], manual["engine_accumulate"])
    )
    _close(manual["params"], found["params"])
