"""Launch modes are told apart by the environment, and a rank whose launcher dies ends with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.launch.launcher import (
    LAUNCHER_PID_ENV,
    Launch,
    check_launch,
    detect_launch,
    external_launch_argv,
)
from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env

TORCHRUN = {
    "RANK": "1",
    "GROUP_RANK": "0",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "TORCHELASTIC_RUN_ID": "abc",
}


def test_launch_modes():
    assert detect_launch({}) == Launch("single", 0, 0, None, None, None)
    # Lightning's subprocess launcher sets LOCAL_RANK, NODE_RANK, WORLD_SIZE and MASTER_*, none of torchelastic's.
    child = detect_launch({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert child.mode == "lightning_child"
    assert not child.external
    torchrun = detect_launch(TORCHRUN)
    assert torchrun == Launch("torchrun", 1, 1, 2, 2, "abc")
    assert torchrun.external


def test_lightning_agrees_that_torchrun_started_the_processes(monkeypatch):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert TorchElasticEnvironment.detect()
    assert TorchElasticEnvironment().creates_processes_externally
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not TorchElasticEnvironment.detect()
    assert detect_launch().mode == "lightning_child"


def test_torchrun_ranks_share_a_run_directory_and_one_record():
    rank1 = detect_launch(TORCHRUN)
    rank0 = detect_launch({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"})
    assert external_launch_argv(["train.py", "x=1"], rank0) == [
        "train.py",
        "x=1",
        "hydra.run.dir=outputs/train/runs/torchrun_abc",
    ]
    assert external_launch_argv(["train.py", "hydra.run.dir=/r"], rank1) == [
        "train.py",
        "hydra.run.dir=/r",
        "hydra.output_subdir=null",
    ]
    single = detect_launch({})
    assert external_launch_argv(["train.py", "x=1"], single) == ["train.py", "x=1"]


def test_a_sweep_under_torchrun_is_refused():
    with pytest.raises(ConfigError, match=r"--multirun=True is invalid: a sweep under torchrun"):
        external_launch_argv(["train.py", "-m", "x=1,2"], detect_launch(TORCHRUN))


@pytest.mark.parametrize("devices", [1, 4, "auto", [0]])
def test_devices_must_match_nproc_per_node(devices):
    launch = detect_launch(TORCHRUN)
    with pytest.raises(ConfigError, match=r"trainer.devices=.* torchrun started 2 processes .* trainer.devices=2"):
        check_launch({"accelerator": "cpu", "devices": devices}, launch)


def test_matching_devices_and_nodes_pass_and_other_launches_are_not_checked():
    launch = detect_launch(TORCHRUN)
    check_launch({"accelerator": "cpu", "devices": 2, "num_nodes": 1}, launch)
    check_launch({"accelerator": "cpu", "devices": "2"}, launch)
    check_launch({"accelerator": "cpu", "devices": 7}, detect_launch({}))
    with pytest.raises(ConfigError, match=r"trainer.num_nodes=2 is invalid: .* set trainer.num_nodes=1"):
        check_launch({"accelerator": "cpu", "devices": 2, "num_nodes": 2}, launch)


_CHILD = (
    "import time\n"
    "from lightning_trainopt.launch.launcher import detect_launch, die_with_parent\n"
    "die_with_parent(detect_launch())\n"
    "print('started', flush=True)\n"
    "time.sleep(120)\n"
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_is_killed_with_its_launcher():
    # A middle process plays the launcher: it starts the rank with its own pid published, then is SIGKILLed.
    launcher = (
        "import os, subprocess, sys, time\n"
        f"env = dict(os.environ, LOCAL_RANK='1', {LAUNCHER_PID_ENV}=str(os.getpid()))\n"
        f"child = subprocess.Popen([sys.executable, '-c', {_CHILD!r}], env=env, stdout=subprocess.PIPE, text=True)\n"
        "assert child.stdout.readline().strip() == 'started'\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher], env=child_env(REPO_ROOT), stdout=subprocess.PIPE, text=True
    )
    rank = int(proc.stdout.readline())
    try:
        assert _alive(rank)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), "the rank outlived its launcher"
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_rank_whose_launcher_is_already_gone_does_not_start():
    env = child_env(REPO_ROOT, LOCAL_RANK="1", **{LAUNCHER_PID_ENV: "999999999"})
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "the launcher of this rank (pid 999999999) has exited" in proc.stderr
    assert "started" not in proc.stdout


def test_importing_the_launcher_guard_imports_neither_torch_nor_lightning():
    # train.py calls die_with_parent before anything heavy: a rank whose launcher is killed during start-up must end
    # within its first fraction of a second. The package's __init__ once imported parallel/ (torch, Lightning,
    # DeepSpeed: 4 s), and CI's kill-during-start-up test found rank 1 still importing after 7 s.
    code = (
        "import sys, lightning_trainopt.launch.launcher as l; "
        "print(sorted(m for m in ('torch', 'lightning', 'deepspeed', 'hydra') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_user_strategy_is_still_answered_by_parallel_after_a_light_package_import():
    # The answerer is registered by the package's __init__ as a thunk that imports parallel/ on the first question.
    code = (
        "from lightning.pytorch.strategies import DeepSpeedStrategy\n"
        "from lightning_trainopt.planner.strategy_layout import registered_answers\n"
        "q = registered_answers(DeepSpeedStrategy(stage=3))\n"
        "print(q.kind, q.zero_stage, q.shards_params)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1].split() == ["deepspeed", "3", "True"], out
