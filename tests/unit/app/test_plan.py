"""plan(cfg) on the real config tree: breakdown, JSON keys, search, hardware-free planning, refusals."""

from __future__ import annotations

import json

import pytest

from lightning_trainopt.app.plan import plan, plan_task
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from tests.helpers.compose import compose_config

DONE = [
    "model=llama_7b",
    "hardware=a100_80gb",
    "trainer.devices=4",
    "+strategy=zero2",
    "precision=bf16",
    "activations=checkpoint",
    "data.seq_len=4096",
    "data.batch_size=1",
]
JSON_KEYS = {
    "n_params",
    "per_device_bytes",
    "cpu_bytes",
    "nvme_bytes",
    "device_memory_bytes",
    "fits",
    "tokens_per_sec_per_device",
    "usd_per_1b_tokens",
}


def test_the_issue_command_plans_llama_7b_on_4_a100(tmp_path):
    result = plan(compose_config(DONE, tmp_path, name="plan"))
    d = result.to_dict()
    assert d.keys() >= JSON_KEYS
    assert set(d["per_device_bytes"]) == {"params", "grads", "optimizer_states", "activations", "other", "total"}
    assert d["n_params"] == 6_738_415_616
    n, w = d["n_params"], 4
    # ZeRO-2 bf16: full bf16 weights; bf16 + fp32 gradient partitions; fp32 master + Adam moments partitioned.
    assert d["per_device_bytes"]["params"] == pytest.approx(2 * n, rel=1e-6)
    # (bf16 partition: + the parameters straddling its edges, whole: 1.5% here)
    assert d["per_device_bytes"]["grads"] == pytest.approx(6 * n / w, rel=0.02)
    assert d["per_device_bytes"]["optimizer_states"] == pytest.approx(12 * n / w, rel=1e-6)
    assert d["per_device_bytes"]["total"] == sum(v for k, v in d["per_device_bytes"].items() if k != "total")
    assert d["device_memory_bytes"] == 80 * 2**30
    assert d["fits"] is True
    assert d["peak_bytes"] <= d["per_device_bytes"]["total"]
    assert d["usd_per_1b_tokens"] > 0
    assert d["tokens_per_sec_per_device"] > 0
    assert result.command.startswith("python train.py model=llama_7b hardware=a100_80gb precision=bf16")
    assert "+strategy=zero2" in result.command
    assert "activations=checkpoint" in result.command


def test_plans_8_devices_on_a_machine_without_them(tmp_path):
    four = plan(compose_config([*DONE[:2], "trainer.devices=4", *DONE[3:]], tmp_path, name="plan"))
    eight = plan(compose_config([*DONE[:2], "trainer.devices=8", *DONE[3:]], tmp_path, name="plan"))
    assert eight.estimate.inputs.world_size == 8
    assert eight.estimate.memory.bytes("optimizer_states") < four.estimate.memory.bytes("optimizer_states")


def test_json_format_prints_json(tmp_path, capsys):
    plan_task(compose_config([*DONE, "plan.format=json"], tmp_path, name="plan"))
    out = json.loads(capsys.readouterr().out)
    assert out.keys() >= JSON_KEYS


def test_rich_format_prints_the_derivation(tmp_path, capsys):
    plan_task(compose_config(DONE, tmp_path, name="plan"))
    out = capsys.readouterr().out
    assert "fp32 master partition" in out
    assert "2+2+12 = 16 B/param" in out
    assert "fits: peak" in out


def test_search_ranks_and_prints_a_winning_command(tmp_path):
    result = plan(
        compose_config([*DONE, "plan.search=true", "plan.search_space.micro_batch=[1,2]"], tmp_path, name="plan")
    )
    assert result.n_enumerated > len(result.candidates) > 0
    assert all(c.estimate.fits for c in result.candidates)
    assert result.command.startswith("python train.py model=llama_7b")
    assert result.to_dict()["search"]["top"][0]["choices"] == result.winner.choices


def test_measured_metrics_replace_the_mfu_assumption(tmp_path):
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"tokens_per_sec": 8000.0, "world_size": 4}))
    result = plan(compose_config([*DONE, f"plan.metrics={metrics}"], tmp_path, name="plan"))
    assert result.estimate.speed.tokens_per_sec_per_device == 2000.0


@pytest.mark.parametrize(
    ("overrides", "error", "key"),
    [
        (["trainer.devices=-1"], ConfigError, "trainer.devices"),
        (["plan.format=xml"], ConfigError, "plan.format"),
        (["plan.mfu=2"], ConfigError, "plan.mfu"),
        (["plan.metrics=/nonexistent/metrics.json"], ConfigError, "plan.metrics"),
        (["optimizer=adamw8bit", "+strategy=zero2_offload"], IncompatibleConfigError, "optimizer"),
    ],
)
def test_bad_config_is_refused_before_anything_runs(tmp_path, overrides, error, key):
    base = [o for o in DONE if not o.startswith("+strategy")] if any("+strategy" in o for o in overrides) else DONE
    with pytest.raises(error, match=key):
        plan_task(compose_config([*base, *overrides], tmp_path, name="plan"))


@pytest.mark.parametrize(
    ("overrides", "temporary"),
    [
        (["precision=bf16"], False),  # LitGPT gives the adamw preset the fused kernel on CUDA
        (["precision=fp16", "trainer.gradient_clip_val=1.0"], True),  # Lightning cannot clip a fused optimizer
        (["precision=fp16", "trainer.gradient_clip_val=0"], False),
        (["precision=bf16", "+optimizer.fused=false"], True),  # torch's CUDA default: foreach
        (["precision=bf16", "+optimizer.foreach=true"], True),
        (["precision=bf16", "hardware=cpu"], False),  # CPU: per-tensor loop, no full-size temporary
    ],
)
def test_adam_sqrt_temporary_follows_the_optimizer_path_train_py_takes(tmp_path, overrides, temporary):
    base = ["model=gpt_125m", "hardware=a100_80gb", "trainer.devices=1", "data.batch_size=1"]
    result = plan(compose_config(base + overrides, tmp_path, name="plan"))
    labels = [t.label for t in result.estimate.memory.terms]
    assert ("foreach Adam sqrt temporary" in labels) is temporary
