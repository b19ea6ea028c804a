"""A user's own DeepSpeed JSON, as written for DeepSpeed itself, through the real app on 2 CPU processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_trainopt.exceptions import ConfigError
from tests.helpers.compose import REPO_ROOT, compose_config
from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

# A typical user JSON: ZeRO-3, its own optimizer, optimizer offload, a global batch instead of an accumulation.
USER_JSON = (
    '{"train_batch_size": 1024, "optimizer": {"type": "AdamW", "params": {"lr": 6e-5}}, '
    '"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}'
)
MICRO_BATCH = 64
# gpt_tiny (the smallest model preset) on 16-token sequences: 1024 / (64 x 2) = 8 cheap micro-steps per step.
COMMON = (
    "trainer=ddp_sim",
    "model=gpt_tiny",
    "data=synthetic",
    f"data.batch_size={MICRO_BATCH}",
    "data.seq_len=16",
    # Not used (the JSON's optimizer block replaces configure_optimizers) but still validated against max_steps.
    "scheduler.warmup_steps=0",
    # Validation runs (2 batches at the end): under ZeRO-3 Lightning re-initialises the engine for it, which needed
    # a key user JSONs do not have.
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
    "logger=none",
)
# What a rank that dies of SIGABRT leaves on the stderr both ranks share: PYTHONFAULTHANDLER makes every Python
# process print "Fatal Python error: Aborted" on SIGABRT, also during interpreter finalization and from a native
# thread; the C++ runtime prints "terminate called" first when an exception escapes. Rank 1's own exit code does not
# reach the test (its launcher, rank 0, may have exited before it), so its stderr is the evidence.
ABORT_MARKERS = ("Fatal Python error", "terminate called", "Aborted", "core dumped")


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_user_json_runs_as_is_with_zero3_cpu_adam_and_derived_accumulation(tmp_path):
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(USER_JSON)
    run_dir = tmp_path / "run"
    # 2 optimizer steps: the per-rank memory breakdown is taken at the second one (Adam's states exist by then).
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "+strategy=deepspeed_json",
            f"strategy.config={ds_json}",
            *COMMON,
            "trainer.max_steps=2",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT, PYTHONFAULTHANDLER="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # ZeRO-3 on 2 processes leaves through the interpreter's exit on both ranks (no os._exit): neither aborts there.
    assert not [m for m in ABORT_MARKERS if m in proc.stderr], proc.stderr[-4000:]
    assert ds_json.read_text() == USER_JSON  # used as is, never rewritten
    m = json.loads((run_dir / "metrics.json").read_text())

    assert m["strategy"] == "deepspeed_json"
    assert m["world_size"] == 2
    assert m["zero_stage"] == 3  # as the DeepSpeed engine reports it
    assert m["offload"] == {"optimizer": "cpu", "param": "none"}
    # DeepSpeed built the JSON's AdamW itself and, under optimizer offload, as its CPU Adam; lr from the JSON (our
    # optimizer preset's lr and scheduler are not used).
    assert m["optimizer"] == {"name": "DeepSpeedCPUAdam", "lr": 6e-5, "lr_now": 6e-5}
    log = proc.stdout + proc.stderr
    assert "DeepSpeedCPUAdam (lr=6e-05, from the DeepSpeed config's optimizer block)" in log
    # train_batch_size = micro-batch x world size x accumulation.
    assert m["micro_batch_size"] == MICRO_BATCH
    assert m["accumulate_grad_batches"] == 1024 // (MICRO_BATCH * 2) == 8
    assert m["global_batch_size"] == 1024
    assert m["global_step"] == 2
    assert m["tokens_seen"] == 2 * 1024 * 16
    assert m["status"] == "ok"
    assert isinstance(m["val_loss"], float)  # the end-of-fit validation ran under ZeRO-3
    assert "using gradient accumulation 8" in log
    # The optimizer states really live on the CPU: fp32 master + 2 moments (12 B/param) of this rank's half.
    opt = m["memory_breakdown"]["optimizer_states"]
    assert opt["device"] == 0
    assert opt["cpu"] == pytest.approx(12 * m["n_params"] / 2, rel=1e-3)


@RunIf(deepspeed=True)
@pytest.mark.parametrize(
    ("json_text", "extra", "key", "fix"),
    [
        # 1000 is not a multiple of micro-batch 64 x 2 processes.
        (USER_JSON.replace("1024", "1000"), (), "strategy.config.train_batch_size=1000", "x world size (2) = 128"),
        # 1024 needs 8 accumulation steps; an explicit, different value is a contradiction, not something to pick.
        (USER_JSON, ("trainer.accumulate_grad_batches=4",), "trainer.accumulate_grad_batches=4", "=8 or remove"),
    ],
    ids=["not_a_multiple", "conflicting_accumulation"],
)
def test_inconsistent_train_batch_size_is_refused_before_any_process_spawns(
    tmp_path, monkeypatch, json_text, extra, key, fix
):
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightning_trainopt.launch.train import train

    def spawned(*args, **kwargs):
        raise AssertionError("a rank was spawned before the config was refused")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", spawned)
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(json_text)
    cfg = compose_config(
        ["+strategy=deepspeed_json", f"strategy.config={ds_json}", *COMMON, "trainer.max_steps=2", *extra], tmp_path
    )
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert str(err.value).startswith(f"{key} is invalid")
    assert fix in str(err.value)
    assert not (tmp_path / "metrics.json").exists()
