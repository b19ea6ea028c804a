"""experiment=distill under FSDP2 on 2 CPU processes (one spawn, _distill_worker.py): the teacher is sharded like the
student, frozen and bit-identical to its checkpoint, outside the optimizer and the student's checkpoint; the sharded
loss equals the one-process loss of the same weights; a resume from the checkpoint (which has no teacher) goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from lightning_trainopt.models import GPT, GPTConfig
from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env

WORKER = Path(__file__).with_name("_distill_worker.py")
TEACHER = GPTConfig(n_layers=2, d_model=48, n_heads=2, ffn_hidden=96, max_seq_len=16)


@pytest.mark.slow
def test_distillation_under_fsdp2_on_two_processes(tmp_path: Path) -> None:
    torch.manual_seed(1)
    teacher = GPT(TEACHER)
    # A Lightning checkpoint as LitGPT writes it: the weights under model., the shape in the hyper-parameters.
    path = tmp_path / "teacher.ckpt"
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in teacher.state_dict().items()},
         "hyper_parameters": {"model": asdict(TEACHER)}},
        path,
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(path), str(tmp_path)],
        cwd=REPO_ROOT, env=child_env(REPO_ROOT), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Its two blocks and then the teacher itself are FSDP2 units; each rank holds half of every tensor.
        assert r["teacher_fsdp_units"] == 3
        assert r["teacher_all_dtensor"]
        assert r["teacher_local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert r["teacher_bit_identical"]
        assert r["teacher_frozen"]
        assert r["teacher_eval"]
        assert not r["teacher_in_optimizer"]
        assert r["sharded_loss"] == pytest.approx(r["reference_loss"], rel=1e-5)
        assert r["train_kl"] > 0
        assert r["checkpoint_teacher_keys"] == []
        assert r["checkpoint_student_keys"] > 0
        assert r["resumed_step"] == 3
        assert r["resumed_teacher_bit_identical"]
