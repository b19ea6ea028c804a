"""``adapter=lora|qlora`` through the app: one device and DDP, with activation checkpointing, int8 activations, bf16
and chunked cross-entropy; checkpoints that hold the adapters without the frozen base, and an exact resume after a
SIGKILL.

Every run carries :class:`tests.helpers.adapter_probe.AdapterProbe`, which writes per rank the frozen base's hash at
the start and the end of the fit, the training losses, and the parameters the optimizer holds state for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_trainopt.checkpoint.adapter_state import ADAPTER_KEY
from lightning_trainopt.launch.train import train
from lightning_trainopt.models import GPTConfig, LitGPT
from tests.helpers.compose import TINY, compose_config
from tests.helpers.hf_files import write_config
from tests.integration.test_resume_mid_epoch import _command, _kill_after_checkpoint, _metrics, _train

PROBE = "tests.helpers.adapter_probe.AdapterProbe"
# stdlib text is learnable; random tokens are not, so a falling loss would say nothing there.
LEARN = ("trainer.max_steps=12", "optimizer.lr=0.01", "data.max_bytes=100000", "trainer.val_check_interval=12")


def _probe(run_dir: Path) -> list[str]:
    return [f"+callbacks.adapter_probe._target_={PROBE}", f"+callbacks.adapter_probe.path={run_dir}"]


def _records(run_dir: Path, ranks: int) -> list[dict]:
    return [json.loads((run_dir / f"adapter_probe_rank{r}.json").read_text()) for r in range(ranks)]


def _check_trained_only_adapters(record: dict, losses_fall: bool = True) -> None:
    # The frozen base is bit-identical after the steps.
    assert record["start_hash"] == record["end_hash"], record["changed"]
    assert record["trainable"]
    assert all(".lora_A." in n or ".lora_B." in n for n in record["trainable"])
    assert record["with_state"] == record["trainable"]  # optimizer states for the adapters, none for the base
    assert record["frozen"] > 0
    if losses_fall:
        losses = record["losses"]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


def test_lora_on_one_device_with_checkpointing_chunked_ce_and_bf16(tmp_path):
    overrides = [*TINY, *LEARN, "adapter=lora", "activations=checkpoint", "loss=chunked_ce", "precision=bf16"]
    metrics = train(compose_config([*overrides, "callbacks=none", *_probe(tmp_path)], tmp_path))
    assert metrics["status"] == "ok"
    (record,) = _records(tmp_path, 1)
    _check_trained_only_adapters(record)
    # metrics.json counts the adapters as what was trained, the base and the adapters as the model.
    assert 0 < metrics["trainable_params"] < metrics["n_params"] / 2


def test_qlora_on_a_hugging_face_llama_with_int8_activations(tmp_path):
    write_config("llama", tmp_path / "llama")
    overrides = [
        "model=hf",
        f"model.config={tmp_path / 'llama'}",
        *TINY[4:],
        *LEARN,
        "adapter=qlora",
        "activations=int8",
        "precision=bf16",
        "callbacks=none",
    ]
    metrics = train(compose_config([*overrides, *_probe(tmp_path)], tmp_path))
    assert metrics["status"] == "ok"
    (record,) = _records(tmp_path, 1)
    _check_trained_only_adapters(record)
    assert any(".q_proj.lora_A." in n for n in record["trainable"])


@pytest.mark.slow
def test_qlora_under_ddp_with_int8_activations_and_bf16(tmp_path):
    args = [*_command(6, 6), "adapter=qlora", "activations=int8", "precision=bf16", "optimizer.lr=0.01"]
    proc = _train([*args, *_probe(tmp_path)], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(tmp_path, 2)
    for record in records:
        _check_trained_only_adapters(record, losses_fall=False)
    # Both ranks hold the same base, and DDP kept their adapters in step (same hash of the base, same loss scale).
    assert records[0]["start_hash"] == records[1]["start_hash"]


MAX_STEPS, STOP = 12, 6


@pytest.fixture(scope="module")
def lora_ddp_resume(tmp_path_factory):
    """LoRA + activation checkpointing + chunked CE on 2 processes (fp32): left alone, and killed after the checkpoint
    at step ``STOP`` then restarted; every start is the same command with ``ckpt_path=auto``."""
    tmp = tmp_path_factory.mktemp("lora_ddp")
    args = [
        *_command(MAX_STEPS, STOP),
        "adapter=lora",
        "activations=checkpoint",
        "loss=chunked_ce",
        "optimizer.lr=0.01",
        "ckpt_path=auto",
    ]
    full = _train([*args, *_probe(tmp / "full")], tmp / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    _kill_after_checkpoint(args, tmp / "killed", STOP)
    resumed = _train(args, tmp / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"full": tmp / "full", "resumed": tmp / "killed"}


@pytest.mark.slow
def test_lora_under_ddp_trains_only_adapters(lora_ddp_resume):
    for record in _records(lora_ddp_resume["full"], 2):
        _check_trained_only_adapters(record)


@pytest.mark.slow
def test_a_killed_lora_run_resumes_to_the_uninterrupted_loss(lora_ddp_resume):
    resumed, full = _metrics(lora_ddp_resume["resumed"]), _metrics(lora_ddp_resume["full"])
    assert resumed["global_step"] == full["global_step"] == MAX_STEPS
    assert resumed["tokens_this_run"] == (MAX_STEPS - STOP) * full["global_batch_size"] * full["seq_len"]
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=1e-6)


@pytest.mark.slow
def test_the_checkpoint_holds_the_adapters_not_the_base(lora_ddp_resume):
    path = lora_ddp_resume["full"] / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    state = checkpoint["state_dict"]
    assert state
    assert all(".lora_A." in k or ".lora_B." in k for k in state)
    record = checkpoint[ADAPTER_KEY]
    assert sorted(state) == record["adapter_tensors"]
    assert record["base_tensors_left_out"] > 0
    assert record["rebuild"]["model"]["n_layers"] == 2
    assert len(record["base_sha256"]) == 64
    # What exact resume needs beside the adapters: optimizer (for the adapters only), schedule, loops, RNG.
    (opt,) = checkpoint["optimizer_states"]
    assert len(opt["state"]) == len(state)
    assert checkpoint["lr_schedulers"]
    assert "loops" in checkpoint
    # Without the base and with optimizer states for the adapters only, the file is less than half of what full
    # training keeps: every weight and its two AdamW states (the model's tensors alone, file overhead left out).
    model = LitGPT(GPTConfig(**record["rebuild"]["model"]))
    model.configure_model()
    full_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    assert path.stat().st_size * 2 < full_bytes, (path.stat().st_size, full_bytes)
