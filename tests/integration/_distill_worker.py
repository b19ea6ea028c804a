"""Worker of test_distill_sharded: distil a tiny GPT from a GPT teacher under FSDP2 on 2 CPU processes.

``python _distill_worker.py TEACHER.ckpt OUT_DIR``: fit 2 steps, then check on every rank that the teacher is
sharded (DTensor parameters of its own FSDP2 units), frozen, bit-identical to its checkpoint, outside the optimizer,
and that the sharded module's loss equals the one-process loss of the same weights; save a checkpoint and check
that it holds no teacher tensor. Writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_trainopt.checkpoint.dcp import read_dcp_tensors
from lightning_trainopt.checkpoint.teacher import teacher_source
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.models.distill import DistillGPT, DistillSpec
from lightning_trainopt.parallel import TrainOptFSDPStrategy
from lightning_trainopt.transforms.distill_loss import distillation_loss

STUDENT = GPTConfig(n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=16)


def main(teacher_path: str, out: Path) -> None:
    pl.seed_everything(0)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    source = teacher_source(teacher_path)
    module = DistillGPT(STUDENT, source, DistillSpec(teacher_path, alpha=0.5, temperature=2.0, chunk_tokens=5))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=TrainOptFSDPStrategy(), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=data)
    teacher = module.teacher
    assert teacher is not None
    saved = source.load_state()
    whole = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in teacher.named_parameters()}
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    x, y = tokens[:2, :-1], tokens[:2, 1:]
    with torch.no_grad():
        sharded_loss = module.batch_loss((x, y))[0].item()
        student_state = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    plain_student, plain_teacher = GPT(STUDENT), GPT(source.config)  # type: ignore[arg-type]
    plain_student.load_state_dict(student_state, strict=False)
    plain_teacher.load_state_dict(dict(saved), strict=False)
    with torch.no_grad():
        ref = distillation_loss(plain_student(x), plain_teacher(x), y, alpha=0.5, temperature=2.0).loss.item()
    ckpt = out / "student.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer.strategy.barrier()
    saved_keys = list(read_dcp_tensors(ckpt, "state_dict."))
    report = {
        "teacher_fsdp_units": sum(isinstance(m, FSDPModule) for m in teacher.modules()),
        "teacher_all_dtensor": all(isinstance(p, DTensor) for p in teacher.parameters()),
        "teacher_local_fraction": sum(p.to_local().numel() for p in teacher.parameters())
        / sum(p.numel() for p in teacher.parameters()),
        "teacher_bit_identical": all(torch.equal(whole[n], saved[n]) for n in whole),
        "teacher_frozen": all(not p.requires_grad and p.grad is None for p in teacher.parameters()),
        "teacher_eval": not teacher.training,
        "teacher_in_optimizer": any(id(p) in optimized for p in teacher.parameters()),
        "sharded_loss": sharded_loss,
        "reference_loss": ref,
        "checkpoint_teacher_keys": [k for k in saved_keys if k.startswith("teacher.")],
        "checkpoint_student_keys": len([k for k in saved_keys if k.startswith("model.")]),
        "train_kl": float(trainer.callback_metrics["train/kl"]),
    }
    # Resume from that checkpoint (which has no teacher): the student goes on, the teacher is read from its source.
    resumed = DistillGPT(STUDENT, source, DistillSpec(teacher_path, alpha=0.5, temperature=2.0, chunk_tokens=5))
    again = pl.Trainer(
        accelerator="cpu", devices=2, strategy=TrainOptFSDPStrategy(), max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    again.fit(resumed, train_dataloaders=data, ckpt_path=str(ckpt))
    assert resumed.teacher is not None
    report["resumed_step"] = again.global_step
    report["resumed_teacher_bit_identical"] = all(
        torch.equal(p.full_tensor(), saved[n]) for n, p in resumed.teacher.named_parameters()
    )
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
