"""`python plan.py ...` end to end: JSON on stdout, and a refused config exits 2 with one line naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "plan.py", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_plan_py_prints_json_for_8_devices_without_them():
    proc = _run(
        "model=llama_13b",
        "hardware=h100",
        "trainer.devices=8",
        "+strategy=zero3",
        "precision=bf16",
        "activations=checkpoint",
        "data.seq_len=4096",
        "data.batch_size=1",
        "plan.format=json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["world_size"] == 8
    assert out["n_params"] == 13_015_864_320
    assert out["fits"] is True
    assert out["usd_per_1b_tokens"] > 0


def test_plan_py_refuses_bad_input_with_the_key():
    proc = _run("trainer.devices=-1")
    assert proc.returncode == 2
    assert "trainer.devices=-1 is invalid" in proc.stderr


def test_plan_py_plans_a_deepspeed_json_as_train_py_runs_it(tmp_path):
    ds = {
        "train_batch_size": 32,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "bf16": {"enabled": True},
    }
    (tmp_path / "ds3.json").write_text(json.dumps(ds))
    proc = _run(
        "model=llama_7b",
        "hardware=a100_80gb",
        "trainer.devices=4",
        "+strategy=deepspeed_json",
        f"strategy.config={tmp_path / 'ds3.json'}",
        "precision=bf16",
        "data.seq_len=2048",
        "data.batch_size=2",
        "plan.format=json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["memory_breakdown"]["optimizer_states"]["device"] == 0
    assert out["memory_breakdown"]["optimizer_states"]["cpu"] > 0
    assert "trainer.accumulate_grad_batches=4" in out["command"]


def test_plan_py_refuses_an_unknown_search_preset_with_exit_2():
    proc = _run("trainer.devices=2", "plan.search=true", "plan.search_space.strategy=[zero9]")
    assert proc.returncode == 2
    assert "plan.search_space.strategy='zero9' is invalid" in proc.stderr


def test_plan_py_refuses_a_bad_hardware_override_with_exit_2():
    proc = _run("hardware=a100_80gb", "hardware.price_per_device_hour=-2")
    assert proc.returncode == 2
    assert "hardware.price_per_device_hour=-2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_plan_that_does_not_fit_exits_0_with_a_next_step():
    proc = _run("model=llama_7b", "hardware=a100_80gb", "trainer.devices=1", "precision=bf16", "data.batch_size=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "does NOT fit" in proc.stdout
    assert "next step:" in proc.stdout
    assert "run it:" not in proc.stdout


@pytest.mark.parametrize(("devices", "code"), [("0,2", 0), ("0,-1", 2)], ids=["one-refused", "all-refused"])
def test_a_plan_sweep_exits_non_zero_only_when_no_job_was_planned(tmp_path, devices, code):
    # As train.py -m: a refused job is reported and the sweep goes on; only a sweep with no result is a failure.
    proc = _run(
        "-m",
        "model=gpt_tiny",
        "hardware=a100_80gb",
        f"trainer.devices={devices}",
        "plan.format=json",
        f"hydra.sweep.dir={tmp_path}",
        # conf/plan.yaml registers this callback; `++` also works once it does.
        "++hydra.callbacks.plan_sweep._target_=lightning_trainopt.config.plan_command.PlanSweepCheck",
    )
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "job 0 refused: trainer.devices=0 is invalid" in proc.stderr
    assert "of 2 plan job(s)" in proc.stderr
    assert json.loads((tmp_path / "0" / "metrics.json").read_text())["status"] == "refused"


def test_plan_py_headline_names_the_default_seq_len_and_the_speed_line_each_flop_figure():
    # The command a new user tries first: no data.seq_len, so the demo data's 128 tokens are planned.
    proc = _run(
        "model=llama_7b",
        "hardware=a100_80gb",
        "trainer.devices=4",
        "+strategy=zero2",
        "precision=bf16",
        "activations=checkpoint",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = " ".join(proc.stdout.split())
    assert "plan: llama_7b (6.738B params) at seq_len 128 (data=stdlib_text default) on 4 x a100_80gb" in out
    assert "note: seq_len 128 is the default of data=stdlib_text" in out
    assert "e.g. data.seq_len=4096" in out
    assert "model FLOP/token (forward + backward) +" in out
    assert "FLOP/token executed; compute at 40% (plan.hfu, of the FLOPs executed) of the 312 TFLOP/s dense bf16" in out
    assert "issue" not in out.lower()


def test_plan_py_plans_tensor_parallel_from_the_strategy_key():
    # strategy.replicate is read the same way; TrainOptFSDPStrategy (+strategy=fsdp) does not take it, so plan.py
    # refuses it there as train.py would, naming the arguments it takes.
    proc = _run(
        "model=llama_13b",
        "hardware=h100",
        "trainer.devices=8",
        "+strategy=fsdp",
        "+strategy.tensor_parallel_size=2",
        "precision=bf16",
        "data.seq_len=4096",
        "data.batch_size=1",
        "plan.format=json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert (out["tensor_parallel"], out["replicate"], out["sequence_parallel"]) == (2, 1, True)
    assert out["data_parallel_size"] == 4
    assert "++strategy.tensor_parallel_size=2" in out["command"]
    assert "strategy.replicate" not in out["command"]  # TrainOptFSDPStrategy takes no replicate
    # TP 2 over NVLink: 40 layers x 4 collectives x 2 x 1/2 x b·s·h·2 B at 450 GB/s
    tp_s = out["step_time"]["serial_s"]["TP collectives (NVLink)"]
    assert tp_s == pytest.approx(40 * 4 * 2 * 0.5 * 4096 * 5120 * 2 / 450e9)


def test_plan_py_search_says_which_parallelism_llama_70b_needs():
    space = [
        "plan.search_space.precision=[bf16]",
        "plan.search_space.strategy=[zero2,fsdp]",
        "plan.search_space.activations=[none]",
        "plan.search_space.optimizer=[adamw]",
        "plan.search_space.micro_batch=[1]",
    ]
    common = ["model=llama_70b", "hardware=h100", "trainer.devices=8", "data.seq_len=4096", "data.batch_size=1"]
    proc = _run(*common, "trainer.num_nodes=8", "plan.search=true", "plan.top_k=3", *space)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert "parallelism: least parallelism that fits: ZeRO-3 / FSDP2 + TP 8" in text
    assert "+strategy=fsdp_tp" in text
    assert "++strategy.tensor_parallel_size=8 ++strategy.replicate=1" in text
    header = next(ln for ln in proc.stdout.splitlines() if "┃ precision" in ln)
    assert all(f"┃ {col} " in header for col in ("TP", "SP", "HSDP"))
