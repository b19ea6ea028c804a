"""``python train.py precision=fp8`` on 2 CPU processes (torchao's FP8 emulated) with ZeRO-2, ZeRO-3 and FSDP2.

Each strategy converts the model before the DeepSpeed engine or ``fully_shard`` wraps it. A run checkpoints at step 2
of 4; a second run resumes from that checkpoint and must end where the uninterrupted run ended, to the last digit
(the checkpoint holds the FP8 model's weights and optimizer state; torchao's tensorwise scaling keeps no state of its
own, its scales are recomputed from the weights each step). The ZeRO-3 checkpoint of the FP8 model converts to a
plain fp32 state dict that loads into the unconverted ``GPT``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

COMMON = [
    "precision=fp8",
    # gpt_tiny's layers are far below torchao's break-even size: convert them anyway, so FP8 really runs.
    "precision.skip_small=false",
    "trainer=ddp_sim",
    "model.n_layers=2",
    "data.batch_size=4",
    "data.seq_len=64",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "+callbacks.model_checkpoint.every_n_train_steps=2",
    "callbacks.model_checkpoint.save_top_k=-1",
]


def _train(run_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run(
        [sys.executable, "train.py", *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    metrics = run_dir / "metrics.json"
    return proc, json.loads(metrics.read_text()) if metrics.exists() else None


def _full_and_resumed(tmp_path: Path, strategy: str) -> tuple[str, dict, dict, Path]:
    full_proc, full = _train(tmp_path / "full", f"+strategy={strategy}")
    assert full_proc.returncode == 0, full_proc.stderr[-4000:]
    (step2,) = (tmp_path / "full" / "checkpoints").glob("step000002*")
    res_proc, resumed = _train(tmp_path / "resumed", f"+strategy={strategy}", f"ckpt_path={step2}")
    assert res_proc.returncode == 0, res_proc.stderr[-4000:]
    assert full is not None
    assert resumed is not None
    return full_proc.stdout + full_proc.stderr, full, resumed, step2


@pytest.mark.slow
@RunIf(deepspeed=True, torchao=True)
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_fp8_trains_and_resumes_exactly(tmp_path, strategy):
    log, full, resumed, step2 = _full_and_resumed(tmp_path, strategy)
    # The conversion happened, before the engine/fully_shard: logged once, on rank 0.
    converted = [line for line in log.splitlines() if "FP8 (torchao tensorwise, emulated in fp32" in line]
    assert len(converted) == 1
    assert "14 of 15 linear layers converted" in converted[0]
    assert ("FP8 all-gather under FSDP2" in converted[0]) is (strategy == "fsdp")
    assert full["status"] == "ok"
    assert full["precision"] == "fp8"
    assert full["trainer_precision"] == "bf16-mixed"
    assert full["zero_stage"] == (3 if strategy == "zero3" else None)
    layers = full["precision_layers"]
    assert (layers["fp8_layers"], layers["bf16_layers"], layers["fsdp_float8_all_gather"]) == (
        14,
        1,
        strategy == "fsdp",
    )
    assert resumed["global_step"] == full["global_step"] == 4
    assert resumed["train_loss"] == full["train_loss"]
    assert resumed["val_loss"] == full["val_loss"]
    if strategy == "zero3":
        from lightning_trainopt.checkpoint.convert import convert_zero_to_fp32

        # Float8Linear keeps nn.Linear's parameter names: the consolidated state dict loads into the plain GPT
        # (convert_zero_to_fp32 checks that strictly, from the shape the checkpoint records).
        state = convert_zero_to_fp32(step2, tmp_path / "plain.pt")
        assert "blocks.0.attn.q_proj.weight" in state


@pytest.mark.slow
@RunIf(deepspeed=True, torchao=True)
def test_fp8_trains_under_zero2(tmp_path):
    proc, metrics = _train(tmp_path, "+strategy=zero2", "trainer.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "14 of 15 linear layers converted" in proc.stdout + proc.stderr
    assert metrics is not None
    assert (metrics["status"], metrics["zero_stage"], metrics["global_step"]) == ("ok", 2, 2)


def test_fp8_te_on_cpu_is_refused_before_training(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "precision=fp8_te", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}"],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "precision='fp8_te' + trainer.accelerator='cpu' is refused" in proc.stderr
    assert "use precision=fp8 (torchao)" in proc.stderr
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.slow
@RunIf(torchao=True)
def test_fp8_on_a_model_below_the_break_even_size_says_no_layer_ran_in_fp8(tmp_path):
    """The default ``skip_small`` on gpt_tiny converts nothing: metrics.json and the printed summary say so, and why."""
    import torch

    from lightning_trainopt.config.model_factory import meta_module
    from tests.helpers.compose import compose_config

    linear = sum(isinstance(m, torch.nn.Linear) for m in meta_module(compose_config(["precision=fp8"])).modules())
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "precision=fp8",
            "trainer.max_steps=2",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO_ROOT,
        # A wide console, so that the summary's row is on one line.
        env=child_env(REPO_ROOT, COLUMNS="250"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    layers = metrics["precision_layers"]
    assert (metrics["status"], metrics["model"], layers["fp8_layers"]) == ("ok", "gpt_tiny", 0)
    causes = {e["cause"]: (e["layers"], e["change"]) for e in layers["not_fp8"]}
    assert causes == {
        "below_break_even": (linear - 1, "precision.skip_small=false"),
        "output_projection": (1, "precision.convert_lm_head=true"),
    }
    said = f"no layer runs in FP8 (0 of {linear} linear layers): {linear - 1} below torchao's break-even size"
    assert layers["warning"].startswith(said)
    (row,) = [line for line in proc.stdout.splitlines() if "precision layers" in line]
    assert said in row
    assert "(change: precision.skip_small=false)" in row
    assert f"precision=fp8: {said}" in proc.stderr  # the warning when the model is converted
