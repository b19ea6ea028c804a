"""LoRA and QLoRA under ZeRO-2, ZeRO-3, FSDP2 and tensor parallelism: 2 gloo processes, real fits (issue #22).

One spawned worker (``_adapter_sharding_worker.py``) fits each case (4 steps; or 2 steps, a checkpoint and a resume for
2 more) and replays the same global batches on one process from the fit's starting weights. Each case must: match the
replay's loss at every step (the adapters' gradients are reduced and applied as on one device), learn (the replay's
first batch scores lower after the steps), keep every frozen weight byte for byte, hold optimizer state for the adapters
only, start with ``lora_B`` at zero (peft's init, which ZeRO-3's ``zero.Init`` used to lose, peft #2916), and resume
from the saved adapters at the saved step (DeepSpeed checkpoints hold the frozen weights too, DeepSpeed #3090). DDP is
the plain case and is covered by the adapter core's own tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_adapter_sharding_worker.py")
# Resumed where the checkpoint's frozen weights are in question (ZeRO-3's partitions, FSDP2's 4-bit shards); each
# resume costs a second fit (~20 s on the shared CI CPUs).
CASES = ("zero2:lora", "zero3:lora:resume", "fsdp:qlora:resume", "tp:lora")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("adapters")
    out = folder / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ADAPTER_WORKER_DIR": str(folder), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), *CASES],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    got = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert set(got) == set(CASES), proc.stderr[-4000:]
    return got


@pytest.mark.parametrize("case", CASES)
def test_adapter_trains_like_one_process(results: dict, case: str) -> None:
    got = results[case]
    *replay, first_after = got["replay"]
    # bf16 compute of the 4-bit base rounds differently on 2 ranks than on one: a looser match for QLoRA
    assert got["losses"] == pytest.approx(replay, rel=1e-4 if "qlora" in case else 1e-6), case
    assert first_after < replay[0] - 0.01, case  # the adapters learned
    assert got["replay_same_base"], case  # the fit's frozen weights are the one-process build's (or were loaded)
    assert got["lora_b_norm_at_start"] == 0.0, case  # peft's init: the model starts as the base


@pytest.mark.parametrize("case", CASES)
def test_adapter_state_and_resume(results: dict, case: str) -> None:
    got = results[case]
    assert got["frozen_changed"] == [False, False], case
    assert got["frozen_numel"] > 2 * got["trainable_numel"], case
    # optimizer state for exactly the adapters (ZeRO's flat partitions may pad; here they divide evenly)
    assert got["state_numel"] == got["trainable_numel"], case
    if case.endswith(":resume"):
        assert got["resumed_step"] == 2, case
        assert got["resumed_from_saved"], case
