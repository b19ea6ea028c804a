"""experiment=distill under FSDP2, tensor parallelism and ZeRO-3 on 2 CPU processes (one spawn, _distill_worker.py):
the teacher is sharded like the student, frozen and bit-identical to its checkpoint, outside the optimizer; the sharded
loss equals the one-process loss of the same weights; under TP each step's loss equals the one-process run of the
same seed (the student built on the meta device gets the eager build's weights); a resume goes on."""

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
from tests.helpers.hf_files import write_pretrained

WORKER = Path(__file__).with_name("_distill_worker.py")
TEACHER = GPTConfig(n_layers=2, d_model=48, n_heads=2, ffn_hidden=96, max_seq_len=16)


@pytest.mark.slow
def test_distillation_under_fsdp2_tp_and_zero3_on_two_processes(tmp_path: Path) -> None:
    torch.manual_seed(1)
    teacher = GPT(TEACHER)
    # A Lightning checkpoint as LitGPT writes it: the weights under model., the shape in the hyper-parameters.
    path = tmp_path / "teacher.ckpt"
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in teacher.state_dict().items()},
         "hyper_parameters": {"model": asdict(TEACHER)}},
        path,
    )  # fmt: skip
    # A Hugging Face student and a larger Hugging Face teacher, as save_pretrained writes them (the tp_hf case).
    write_pretrained("llama", tmp_path / "hf" / "student", seed=2)
    write_pretrained("llama", tmp_path / "hf" / "teacher", seed=3, hidden_size=48, intermediate_size=96)
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(path), str(tmp_path), str(tmp_path / "hf")],
        cwd=REPO_ROOT, env=child_env(REPO_ROOT), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        r = report["fsdp"]
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

        # Tensor parallelism: the same seed, the batches the fit saw, replayed on one process from an eager build.
        t = report["tp"]
        assert t["student_dtensor"]
        assert t["teacher_head_placements"] == ["S(0)"]  # the teacher split by the student's plan
        assert t["teacher_local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert t["teacher_bit_identical"]
        assert t["teacher_frozen"]
        assert len(t["tp_loss"]) == len(t["one_loss"]) == 3
        assert t["tp_loss"] == pytest.approx(t["one_loss"], abs=1e-4)
        assert t["tp_ce"] == pytest.approx(t["one_ce"], abs=1e-4)
        assert t["tp_loss"][0] != t["tp_loss"][-1]  # it trained
        # The loss is vocabulary-parallel: no rank computed a logits chunk wider than its V / 2 rows.
        assert t["tp_logits_width"] == t["vocab"] // 2
        assert t["head_gradient"]["whole_logits_width"] == t["vocab"]
        for kind in ("forward", "reverse"):
            g = t["head_gradient"][kind]
            assert g["loss"] == pytest.approx(g["want_loss"], abs=1e-4)
            assert g["head_grad_max"] > 0
            assert g["head_grad_max_diff"] <= 1e-4 * g["head_grad_max"]

        # A Hugging Face teacher (Llama, save_pretrained) and student under TP 2: the teacher split by the student's
        # plan, as it is in its files, frozen; the loss of the same weights equals the one-process one.
        h = report["tp_hf"]
        assert h["teacher_head_placements"] == ["S(0)"]
        assert h["teacher_all_dtensor_matrices"]
        assert h["teacher_local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert h["teacher_bit_identical"]
        assert h["teacher_frozen"]
        assert h["teacher_eval"]
        assert h["student_state_loaded"]
        assert h["tp_loss"] == pytest.approx(h["one_loss"], rel=1e-5)
        assert h["train_kl"] > 0
        assert h["tp_logits_width"] == h["vocab"] // 2

        # ZeRO-3: the teacher partitioned by zero.Init (half of it per rank), frozen, outside DeepSpeed's optimizer.
        z = report["zero3"]
        assert z["teacher_partitioned"]
        assert z["teacher_local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert z["teacher_bit_identical"]
        assert z["teacher_frozen"]
        assert z["teacher_eval"]
        assert not z["teacher_in_optimizer"]
        assert z["student_in_optimizer"]
        assert z["sharded_loss"] == pytest.approx(z["reference_loss"], rel=1e-5)
        assert z["train_kl"] > 0
        # The module is saved without its teacher: neither its module keys nor its frozen fragments are in
        # DeepSpeed's files; the resume loads the student alone and reads the teacher from its source.
        assert z["checkpoint_teacher_fragments"] == 0
        assert z["checkpoint_teacher_module_keys"] == 0
        assert z["checkpoint_student_module_keys"] > 0
        assert z["resumed_step"] == 3
        assert z["resumed_teacher_bit_identical"]
        # A checkpoint written with the teacher inside (before it was left out) still resumes: its module state is
        # loaded with the teacher's keys, and the student comes out as from the checkpoint without them.
        assert z["legacy_teacher_module_keys"] > 0
        assert z["legacy_teacher_fragments"] > 0
        assert z["legacy_step"] == 3
        assert z["legacy_teacher_bit_identical"]
        assert z["student_moved_since_save"]
        assert z["legacy_student_equals_resumed"]
