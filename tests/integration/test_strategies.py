"""Strategy presets on 2 CPU processes (gloo): resume with the same loss trajectory, and the sharding shows per rank.

Each case runs ``bench/strategies.py --single`` in a subprocess (Lightning's launcher re-executes that script for
rank 1), so pytest itself never forks into a process group.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "strategies.py"


def _run(tmp_path, name, *args, timeout=240):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(BENCH), *map(str, args), "--out", str(out)]
    proc = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


# Resumed losses must equal the uninterrupted run's. Tolerance 1e-6 (absolute): on CPU in fp32 every kernel and
# every gloo reduction is deterministic, the checkpoint is taken at an epoch boundary (3 batches per epoch) so the
# seeded DistributedSampler replays the same order, and the checkpoint holds the exact fp32 model, optimizer and
# scheduler state; in practice the trajectories are bit-identical.
@pytest.mark.slow
@RunIf(deepspeed=True)
@pytest.mark.parametrize(
    "preset", ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp", "fsdp_offload"]
)
def test_resume_continues_the_same_loss_trajectory(tmp_path, preset):
    common = ["--single", preset, "--devices", 2, "--precision", "32-true", "--epoch-batches", 3, "--max-steps", 6]
    full = _run(tmp_path, "full", *common, "--ckpt-dir", tmp_path / "ck", "--ckpt-every", 3)
    ckpt = tmp_path / "ck" / "step3.ckpt"
    assert ckpt.exists()
    assert not [p for p in (tmp_path / "ck").iterdir() if ".partial-" in p.name]  # staging paths were committed
    resumed = _run(tmp_path, "resumed", *common, "--resume", ckpt)
    assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    for step, loss in resumed["losses"].items():
        assert abs(loss - full["losses"][step]) <= 1e-6, (step, loss, full["losses"][step])


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_zero2_halves_grads_and_optimizer_states_but_not_params(tmp_path):
    one = _run(tmp_path, "one", "--single", "zero2", "--devices", 1, "--max-steps", 3)["memory_breakdown"]
    two = _run(tmp_path, "two", "--single", "zero2", "--devices", 2, "--max-steps", 3)["memory_breakdown"]

    def total(mb, cat):
        return sum(mb[cat].values())

    assert total(two, "params") == total(one, "params")
    # Optimizer states halve to within DeepSpeed's partition padding. The gradient partition measured 2.0% above one
    # half on this model (3,295,744 vs 3,229,952 bytes, bf16): DeepSpeed bookkeeping not itemised yet, hence rel=0.03.
    assert total(two, "optimizer_states") == pytest.approx(total(one, "optimizer_states") / 2, rel=0.01)
    assert total(two, "grads") == pytest.approx(total(one, "grads") / 2, rel=0.03)


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_zero3_checkpoint_converts_to_a_plain_gpt_state_dict(tmp_path):
    import torch

    from lightning_trainopt.app.convert import convert_zero_to_fp32
    from lightning_trainopt.models import GPT, GPTConfig

    report = _run(
        tmp_path, "z3", "--single", "zero3", "--devices", 2, "--max-steps", 2, "--save-to", tmp_path / "z3.ckpt"
    )
    assert report["zero_stage"] == 3
    state = convert_zero_to_fp32(tmp_path / "z3.ckpt", tmp_path / "gpt.pt")
    model = GPT(
        GPTConfig(name="bench", vocab_size=256, n_layers=4, d_model=256, n_heads=4, ffn_hidden=688, max_seq_len=64)
    )
    model.load_state_dict(torch.load(tmp_path / "gpt.pt"), strict=True)
    assert all(t.dtype == torch.float32 for t in state.values())
    assert sum(t.numel() for k, t in state.items() if k != "lm_head.weight") == report["n_params"]
    # Trained from GPT's N(0, 0.02) init (not torch's N(0, 1) embedding default that ZeRO-3 init would leave).
    assert 0.015 < float(state["embed.weight"].std()) < 0.025
