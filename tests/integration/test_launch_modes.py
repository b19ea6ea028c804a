"""``train.py`` under torchrun (every rank started outside Lightning) and the fate of ranks whose launcher dies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.compose import REPO_ROOT, SMALL_RUN
from tests.helpers.env import child_env
from tests.helpers.torchrun import two_nodes

SMALL = ["trainer=ddp_sim", *SMALL_RUN]
TRAIN = str(REPO_ROOT / "train.py")
SUMMARY = "lightning_trainopt run summary"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH"),
]


def _torchrun(args: list[str], cwd: Path, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = ["torchrun", "--standalone", "--nproc_per_node", str(nproc), TRAIN, *args]
    return subprocess.run(cmd, cwd=cwd, env=child_env(REPO_ROOT), capture_output=True, text=True, timeout=timeout)


def test_torchrun_trains_like_lightnings_launcher_and_rank0_alone_reports(tmp_path):
    args = [*SMALL, "+strategy=ddp", "trainer.max_steps=5"]
    proc = _torchrun(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # No hydra.run.dir on the command line: both ranks agreed on one directory named by torchrun's rendezvous id.
    runs = list((tmp_path / "outputs" / "train" / "runs").iterdir())
    assert [p.name[: len("torchrun_")] for p in runs] == ["torchrun_"], runs
    by_torchrun = json.loads((runs[0] / "metrics.json").read_text())
    assert by_torchrun["world_size"] == 2
    assert by_torchrun["global_step"] == 5
    assert proc.stdout.count(SUMMARY) == 1, "a rank other than 0 reported the run"
    assert not list(runs[0].glob("*/.hydra"))
    assert (runs[0] / ".hydra" / "config.yaml").is_file()

    lightning_dir = tmp_path / "by_lightning"
    launched = subprocess.run(
        [sys.executable, TRAIN, *args, f"hydra.run.dir={lightning_dir}"],
        cwd=tmp_path,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert launched.returncode == 0, launched.stderr[-4000:]
    by_lightning = json.loads((lightning_dir / "metrics.json").read_text())
    for key in ("train_loss", "val_loss"):
        assert by_torchrun[key] == pytest.approx(by_lightning[key], rel=1e-6), key


def test_two_nodes_of_two_train_like_one_node_of_four(tmp_path):
    # Two "nodes" on this machine: two torchrun agents, --node-rank 0 and 1, meeting at a loopback address (static
    # rendezvous), trainer.num_nodes=2 (Lightning's TorchElasticEnvironment). The same 4 ranks on one node must
    # train the same model: same global batch, same samples per global rank.
    args = [*SMALL, "+strategy=ddp", "trainer.max_steps=3", "trainer.limit_val_batches=1"]
    run = tmp_path / "two_nodes"
    outs = two_nodes(args, run, cwd=tmp_path)
    by_two = json.loads((run / "metrics.json").read_text())
    assert (by_two["world_size"], by_two["devices"], by_two["global_step"]) == (4, 2, 3)
    assert sum(out.count(SUMMARY) for out in outs) == 1, "a rank other than global rank 0 reported the run"

    # The reference: 4 ranks on one node. Pre-flight allows one CPU process per core and this machine may have 2,
    # so the reference ranks (only they) are told of 4 cores; slower, the same arithmetic.
    cores = tmp_path / "four_cores"
    cores.mkdir()
    (cores / "sitecustomize.py").write_text("import os\nos.cpu_count = lambda: 4\n")
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc_per_node", "4", TRAIN, *args, "trainer.devices=4"]
        + [f"hydra.run.dir={tmp_path / 'one_node'}"],
        cwd=tmp_path,
        env={**child_env(REPO_ROOT), "PYTHONPATH": os.pathsep.join([str(cores), child_env(REPO_ROOT)["PYTHONPATH"]])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_one = json.loads((tmp_path / "one_node" / "metrics.json").read_text())
    assert (by_one["world_size"], by_one["global_batch_size"]) == (4, by_two["global_batch_size"])
    for key in ("train_loss", "val_loss"):
        assert by_two[key] == pytest.approx(by_one[key], rel=1e-6), key


def test_torchrun_refuses_devices_that_differ_from_nproc_per_node(tmp_path):
    proc = _torchrun([*SMALL, "+strategy=ddp", "trainer.max_steps=5", "trainer.devices=1"], tmp_path)
    assert proc.returncode != 0
    # A rank refuses with the one line and exit code 2 (torchrun then prints its own report of the failure). torchrun
    # terminates the other workers as soon as one fails, so the slower rank has refused too, or was stopped first
    # (CI-like load decides which: both happened); no rank got as far as the process group.
    refusals = proc.stderr.count("error: trainer.devices=1 is invalid: torchrun started 2 processes on this node")
    assert refusals in (1, 2), proc.stderr[-3000:]
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert "set trainer.devices=2" in proc.stderr
    assert "exitcode  : 2" in proc.stderr
    assert not list(tmp_path.rglob("metrics.json"))


def test_zero3_ranks_exit_cleanly_under_torchrun(tmp_path):
    # torchrun reports every worker's exit code, so a rank that aborts at interpreter exit fails the run: the ranks
    # leave through the interpreter's normal exit, with the process group and DeepSpeed's state torn down first.
    proc = _torchrun([*SMALL, "+strategy=zero3", "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "exitcode" not in proc.stderr
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["zero_stage"] == 3


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_ends_when_its_launcher_is_killed_during_start_up(tmp_path):
    rank0 = subprocess.Popen(
        [sys.executable, TRAIN, *SMALL, "+strategy=zero2", "trainer.max_steps=50", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        env=child_env(REPO_ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rank1: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not rank1 and time.monotonic() < deadline and rank0.poll() is None:
            rank1 = [p for p in _children(rank0.pid) if "train.py" in Path(f"/proc/{p}/cmdline").read_text()]
            time.sleep(0.2)
        assert rank1, "rank 0 never started rank 1"
        time.sleep(2.0)  # rank 1 is importing and joining the process group: DeepSpeed start-up
        assert _alive(rank1[0])
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait()
        gone_by = time.monotonic() + 5
        while _alive(rank1[0]) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not _alive(rank1[0]), "rank 1 outlived its launcher"
    finally:
        if rank0.poll() is None:
            rank0.kill()
        for pid in rank1:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
