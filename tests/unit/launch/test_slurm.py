"""SLURM launch mode: told apart as Lightning does, run directory keyed by the job, allocations checked before start.

The environments are those a real ``sbatch -N1 --ntasks-per-node=2`` gave on the local SLURM 22.05 of
``tests/helpers/slurm.py``: the batch script, and task 1 of ``srun`` inside it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.launch.launcher import Launch, check_launch, detect_launch, external_launch_argv
from lightning_trainopt.launch.slurm import newest_resume_point, slurm_tasks

BATCH = {
    "SLURM_JOB_ID": "41",
    "SLURM_JOB_NAME": "job.sh",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "2",
}
STEP = {
    **BATCH,
    "SLURM_LOCALID": "1",
    "SLURM_PROCID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
}
CPU2 = {"accelerator": "cpu", "devices": 2, "num_nodes": 1}


def test_an_srun_task_is_a_slurm_rank_and_lightning_agrees(monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    assert detect_launch(STEP) == Launch("slurm", 1, 1, 2, 2, "41")
    assert detect_launch(STEP).external
    for key, value in STEP.items():
        monkeypatch.setenv(key, value)
    assert SLURMEnvironment.detect()
    env = SLURMEnvironment()
    assert (env.global_rank(), env.local_rank(), env.world_size()) == (1, 1, 2)
    # An allocation for an interactive shell is not SLURM's to launch, for Lightning or for us.
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")
    assert not SLURMEnvironment.detect()
    assert detect_launch().mode == "single"


def test_job_arrays_and_torchrun_inside_slurm():
    array = detect_launch({**STEP, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"})
    assert array.run_id == "40_3"
    # torchrun inside an allocation: Lightning takes TorchElastic first, and so do we.
    assert detect_launch({**STEP, "TORCHELASTIC_RUN_ID": "r", "LOCAL_WORLD_SIZE": "2"}).mode == "torchrun"


def test_tasks_per_node_from_slurms_compressed_list():
    step = {k: v for k, v in STEP.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert slurm_tasks({**step, "SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}) == (
        7,
        1,
    )
    assert slurm_tasks({**step, "SLURM_STEP_TASKS_PER_NODE": "odd"}) == (2, None)


def test_the_run_directory_is_the_jobs_so_a_requeued_job_finds_it_again():
    rank0 = detect_launch({**STEP, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert external_launch_argv(["train.py", "x=1"], rank0) == [
        "train.py",
        "x=1",
        "hydra.run.dir=outputs/train/runs/slurm_41",
    ]
    assert external_launch_argv(["train.py"], detect_launch(STEP))[-1] == "hydra.output_subdir=null"
    with pytest.raises(ConfigError, match=r"--multirun=True is invalid: a sweep under slurm"):
        external_launch_argv(["train.py", "-m", "x=1,2"], rank0)


def test_a_matching_allocation_passes():
    check_launch(CPU2, env=STEP)
    check_launch({"accelerator": "cpu", "devices": 1}, env={**BATCH, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"})


@pytest.mark.parametrize(
    ("env", "trainer", "message"),
    [
        # python instead of srun in a job of 2 tasks: rank 0 alone, waiting for rank 1.
        (BATCH, CPU2, r"command='python train.py' is invalid: .* 2 tasks .* srun python train.py"),
        ({**STEP, "SLURM_GPU_BIND": "closest"}, CPU2, r"--gpu-bind='closest' is invalid: .* drop --gpu-bind"),
        (
            {k: v for k, v in STEP.items() if k != "SLURM_NTASKS_PER_NODE"},
            CPU2,
            r"--ntasks=2 is invalid: .* --nodes=1 --ntasks-per-node=2 instead",
        ),
        (STEP, {**CPU2, "devices": 4}, r"trainer.devices=4 is invalid: SLURM started 2 task\(s\) on this node"),
        (STEP, {**CPU2, "num_nodes": 2}, r"trainer.num_nodes=2 is invalid: .* 1 node\(s\); set trainer.num_nodes=1"),
        # Lightning #20391: fewer tasks than tasks per node; Lightning's world size would be SLURM_NTASKS.
        (
            {**STEP, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_STEP_TASKS_PER_NODE": "2"},
            {**CPU2, "devices": 4},
            r"SLURM_NTASKS=2 is invalid: trainer.devices=4 x trainer.num_nodes=1 is 4 ranks .* world size of 2",
        ),
    ],
)
def test_allocations_that_disagree_are_refused(env, trainer, message):
    with pytest.raises(ConfigError, match=message):
        check_launch(trainer, env=env)


def test_auto_resume_takes_lightnings_requeue_checkpoint_when_newer(tmp_path: Path):
    import torch

    (tmp_path / "checkpoints").mkdir()
    periodic = tmp_path / "checkpoints" / "step=2.ckpt"
    torch.save({"global_step": 2}, periodic)
    assert newest_resume_point(str(periodic), tmp_path) == str(periodic)
    requeue = tmp_path / "hpc_ckpt_1.ckpt"
    torch.save({"global_step": 3}, requeue)
    later = time.time() + 5
    os.utime(requeue, (later, later))
    assert newest_resume_point(str(periodic), tmp_path) == str(requeue)
    assert newest_resume_point(None, tmp_path) == str(requeue)
    # A requeue checkpoint cut short is not a resume point.
    requeue.write_bytes(requeue.read_bytes()[:-40])
    assert newest_resume_point(str(periodic), tmp_path) == str(periodic)


def test_a_submitit_local_job_has_one_task_per_device():
    local = {"SUBMITIT_LOCAL_JOB_ID": "123"}
    check_launch({"accelerator": "cpu", "devices": 1}, env=local)
    with pytest.raises(ConfigError, match=r"trainer.devices=2 is invalid: this job of hydra/launcher=submitit_local "):
        check_launch(CPU2, env=local)
    with pytest.raises(ConfigError, match=r"hydra.launcher.tasks_per_node=2"):
        check_launch(CPU2, env={**local, "SUBMITIT_LOCAL_NTASKS": "1"})
    with pytest.raises(ConfigError, match=r"trainer.num_nodes=2 is invalid"):
        check_launch({**CPU2, "num_nodes": 2}, env={**local, "SUBMITIT_LOCAL_NTASKS": "2"})


def test_a_task_of_a_submitit_local_job_of_two_becomes_one_rank_as_under_torchrun():
    from lightning_trainopt.launch.launcher import adopt_submitit_local_ranks

    env = {"SUBMITIT_LOCAL_JOB_ID": "23456", "SUBMITIT_LOCAL_NTASKS": "2"}
    env |= {"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1"}
    assert adopt_submitit_local_ranks(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "2", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "13456")  # 10000 + 23456 % 20000
    launch = detect_launch(env)
    assert (launch.mode, launch.rank, launch.world_size) == ("torchrun", 1, 2)
    check_launch(CPU2, env=env)  # trainer.devices = the job's tasks
    one = {"SUBMITIT_LOCAL_JOB_ID": "23456", "SUBMITIT_LOCAL_NTASKS": "1"}
    assert not adopt_submitit_local_ranks(one)
    assert "RANK" not in one
