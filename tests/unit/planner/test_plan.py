"""plan(cfg) on the real config tree: breakdown, JSON keys, search, hardware-free planning, refusals."""

from __future__ import annotations

import json

import pytest

from lightning_trainopt.config.plan import plan, plan_task
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
    assert result.command.startswith("python train.py model=llama_7b hardware=a100_80gb +strategy=zero2 precision=bf16")
    assert "activations=checkpoint" in result.command
    # DeepSpeed steps torch AdamW (foreach on CUDA) on the flat fp32 partition: its sqrt temporary is in the peak.
    labels = {t.label: t.nbytes for t in result.estimate.memory.terms}
    assert labels["Adam foreach sqrt temporary"] == pytest.approx(4 * n / w, rel=1e-3)
    assert d["headroom_bytes"] == int(0.05 * 80 * 2**30)
    assert d["margin_bytes"] == d["device_memory_bytes"] - d["headroom_bytes"] - d["peak_bytes"]


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


LLAMA_7B_RUN = {
    "n_params": 6_738_415_616,
    "seq_len": 4096,
    "trainer_precision": "bf16-mixed",
    "accelerator": "cuda",
    "tokens_per_sec": 8000.0,
    "world_size": 4,
}


def test_measured_metrics_replace_the_mfu_assumption(tmp_path):
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps(LLAMA_7B_RUN))
    result = plan(compose_config([*DONE, f"plan.metrics={metrics}"], tmp_path, name="plan"))
    assert result.estimate.speed.tokens_per_sec_per_device == 2000.0
    assert result.to_dict()["speed_measured"] is True


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_params", 1_000_000), ("seq_len", 128), ("trainer_precision", "32-true"), ("accelerator", "cpu")],
)
def test_metrics_of_another_run_are_refused_naming_the_field(tmp_path, field, value):
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({**LLAMA_7B_RUN, field: value}))
    with pytest.raises(ConfigError, match=f"plan.metrics.*{field}"):
        plan(compose_config([*DONE, f"plan.metrics={metrics}"], tmp_path, name="plan"))


def test_measured_speed_applies_to_the_planned_row_only_in_a_search(tmp_path):
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps(LLAMA_7B_RUN))
    result = plan(
        compose_config(
            [*DONE, f"plan.metrics={metrics}", "plan.search=true", "plan.search_space.micro_batch=[1]"],
            tmp_path,
            name="plan",
        )
    )
    by_measured = {c.estimate.speed.source.startswith("measured") for c in result.candidates}
    assert by_measured == {True, False}
    for c in result.candidates:
        same = c.estimate.inputs == result.estimate.inputs
        assert c.estimate.speed.source.startswith("measured") is same
    rows = result.to_dict()["search"]["top"]
    assert all("speed_measured" in r for r in rows)


@pytest.mark.parametrize(
    ("overrides", "error", "key"),
    [
        (["trainer.devices=-1"], ConfigError, "trainer.devices"),
        (["plan.format=xml"], ConfigError, "plan.format"),
        (["plan.hfu=2"], ConfigError, "plan.hfu"),
        (["plan.metrics=/nonexistent/metrics.json"], ConfigError, "plan.metrics"),
        (["optimizer=adamw8bit", "+strategy=zero2_offload"], IncompatibleConfigError, "optimizer"),
        # train.py's pre-flight refuses these; so must the planner (one shared rule set).
        (["optimizer=adamw8bit", "+strategy=fsdp"], IncompatibleConfigError, "optimizer"),
        (["precision=fp16", "hardware=cpu", "trainer.devices=2", "+strategy=zero2"], IncompatibleConfigError, "fp16"),
        (["trainer.accumulate_grad_batches=0"], ConfigError, "trainer.accumulate_grad_batches"),
        (["plan.top_k=0"], ConfigError, "plan.top_k"),
        (["plan.top_k=-1"], ConfigError, "plan.top_k"),
        (["plan.headroom_fraction=1.5"], ConfigError, "plan.headroom_fraction"),
    ],
)
def test_bad_config_is_refused_before_anything_runs(tmp_path, overrides, error, key):
    drop = {o.split("=")[0] for o in overrides}
    base = [o for o in DONE if o.split("=")[0] not in drop]
    with pytest.raises(error, match=key):
        plan_task(compose_config([*base, *overrides], tmp_path, name="plan"))


@pytest.mark.parametrize(
    ("overrides", "temporary"),
    [
        (["precision=bf16"], None),  # LitGPT gives the adamw preset the fused kernel on CUDA
        (["precision=fp16", "trainer.gradient_clip_val=1.0"], "foreach"),  # Lightning cannot clip a fused optimizer
        (["precision=fp16", "trainer.gradient_clip_val=null"], None),  # train.py refuses 0: null switches clipping off
        (["precision=bf16", "+optimizer.fused=false"], "foreach"),  # torch's CUDA default: foreach
        (["precision=bf16", "+optimizer.foreach=true"], "foreach"),
        (["precision=bf16", "+strategy=zero2", "trainer.devices=2"], "foreach"),  # DeepSpeed: no fused kernel
        (["precision=bf16", "+strategy=zero2_offload", "trainer.devices=2"], None),  # DeepSpeedCPUAdam in place
        (["precision=bf16", "+strategy=fsdp", "trainer.devices=2"], None),  # fused on CUDA
        (["precision=bf16", "hardware=cpu"], "single_tensor"),  # CPU: per-tensor sqrt and quotient
    ],
)
def test_adam_step_temporary_follows_the_optimizer_path_train_py_takes(tmp_path, overrides, temporary):
    base = ["model=gpt_125m", "hardware=a100_80gb", "trainer.devices=1", "data.batch_size=1"]
    result = plan(compose_config(base + overrides, tmp_path, name="plan"))
    labels = {t.label for t in result.estimate.memory.terms if t.phase == "in_step" and t.category == "other"}
    expected = {
        None: set(),
        "foreach": {"Adam foreach sqrt temporary"},
        "single_tensor": {"Adam sqrt/div temporaries (largest tensor)"},
    }[temporary]
    assert labels == expected


def test_the_printed_command_composes_to_the_planned_model_data_and_trainer(tmp_path):
    overrides = [
        "model=llama_7b",
        "model.n_layers=16",
        "model.max_seq_len=8192",
        "data.seq_len=8192",
        "hardware=a100_80gb",
        "hardware.price_per_device_hour=2.0",
        "trainer.devices=4",
        "+strategy=zero2",
        "precision=bf16",
        "plan.format=json",
    ]
    result = plan(compose_config(overrides, tmp_path, name="plan"))
    args = result.command.split()[2:]
    assert not any(a.startswith("plan.") for a in args)
    train_cfg = compose_config(args, tmp_path, name="train")
    i = result.estimate.inputs
    assert train_cfg.model.n_layers == 16
    assert train_cfg.model.max_seq_len == 8192
    assert train_cfg.model.n_layers == i.model.n_layers
    assert train_cfg.model.d_model == i.model.d_model
    assert train_cfg.data.seq_len == i.seq_len == 8192
    assert train_cfg.data.batch_size == i.micro_batch
    assert train_cfg.trainer.devices == i.devices
    assert train_cfg.trainer.accumulate_grad_batches == i.accumulate
    assert train_cfg.hardware.price_per_device_hour == 2.0
    assert train_cfg.strategy.preset == "zero2"
    assert train_cfg.precision.trainer_precision == i.trainer_precision


def test_the_search_winner_command_composes_with_the_winners_groups(tmp_path):
    overrides = [
        *DONE,
        "model.n_layers=8",
        "optimizer.lr=1e-4",
        "plan.search=true",
        "plan.search_space.micro_batch=[1,2]",
    ]
    result = plan(compose_config(overrides, tmp_path, name="plan"))
    win = result.winner.estimate.inputs
    train_cfg = compose_config(result.command.split()[2:], tmp_path, name="train")
    assert train_cfg.model.n_layers == 8
    assert train_cfg.data.batch_size == win.micro_batch
    assert train_cfg.trainer.accumulate_grad_batches == win.accumulate
    assert train_cfg.precision.trainer_precision == win.trainer_precision
    assert (train_cfg.get("strategy") or {}).get("preset", "ddp") == result.winner.choices["strategy"]


def test_search_enumerates_exactly_what_train_py_accepts(tmp_path):
    result = plan(
        compose_config(
            [*DONE, "plan.search=true", "plan.search_space.micro_batch=[1]", "plan.headroom_fraction=0"],
            tmp_path,
            name="plan",
        )
    )
    pairs = {(c.choices["strategy"], c.choices["optimizer"]) for c in result.candidates}
    assert ("zero2", "adamw8bit") in pairs  # DeepSpeed hands bitsandbytes flat local partitions: train.py runs it
    assert ("fsdp", "adamw8bit") not in pairs  # pre-flight rule "8-bit optimizer + FSDP"
    assert ("zero2_offload", "adamw8bit") not in pairs  # pre-flight rule "8-bit optimizer + offload"
