"""Worker of test_distill_sharded: distil a tiny GPT from a GPT teacher on 2 CPU processes under FSDP2, tensor
parallelism and ZeRO-3, one after another in the same pair of processes (one spawn).

``python _distill_worker.py TEACHER.ckpt OUT_DIR HF_DIR``. Writes ``OUT_DIR/rank{R}.json``: ``{"fsdp": ..., "tp": ...,
"tp_hf": ..., "zero3": ...}``.

- ``fsdp``: fit 2 steps, then check that the teacher is sharded (DTensor parameters of its own FSDP2 units), frozen,
  bit-identical to its checkpoint, outside the optimizer; that the sharded module's loss equals the one-process loss
  of the same weights; save a checkpoint, check it holds no teacher tensor, and resume from it.
- ``tp``: fit 3 steps from the seed (the student built on the meta device and initialised rank by rank) and replay the
  batches the fit saw on one process from the same seed built eagerly (no weights copied): the losses of each step,
  and the widest logits chunk a rank computed (the vocabulary-parallel loss: ``V / tp``); then, for the forward and
  the reverse KL, the student head's gradient of one batch against the gathered version's (one process, whole head).
- ``tp_hf``: a Hugging Face student (``HF_DIR/student``) and teacher (``HF_DIR/teacher``, a larger Llama), both
  written by ``save_pretrained``: fit 2 steps under TP 2, then check the teacher is split (its head ``Shard(0)``, half
  of it per rank), frozen, bit-identical to its files, and the module's loss of a batch against the one-process loss
  of the same weights (plain ``transformers`` models, the whole-logits formula).
- ``zero3``: as ``fsdp``, the teacher partitioned by ``zero.Init``; the checkpoint's teacher tensors are counted (its
  frozen fragments and module keys: none, the module is saved without its teacher). A second checkpoint is written
  with the teacher inside, as before the teacher was left out; a resume from each reaches the same student.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_trainopt.checkpoint.dcp import read_dcp_tensors
from lightning_trainopt.checkpoint.teacher import teacher_source
from lightning_trainopt.launch.multirun import teardown_distributed
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.models.distill import DistillCausalLM, DistillGPT, DistillSpec, TeacherSource
from lightning_trainopt.models.hf_config import HFModelConfig
from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy, TrainOptFSDPStrategy
from lightning_trainopt.parallel.tp_strategy import TrainOptTPStrategy
from lightning_trainopt.transforms.distill_loss import distillation_loss

STUDENT = GPTConfig(n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=16)
TOKENS = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _data() -> DataLoader:
    return DataLoader(TensorDataset(TOKENS[:, :-1], TOKENS[:, 1:]), batch_size=2)


def _module(source: TeacherSource) -> DistillGPT:
    return DistillGPT(STUDENT, source, DistillSpec(source.path, alpha=0.5, temperature=2.0, chunk_tokens=5))


def _trainer(strategy: Any, max_steps: int, callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _next_process_group() -> None:
    """A fresh process group on a fresh port for the next strategy (as the adapter worker does)."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    port = [find_free_network_port() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    teardown_distributed()


def _reference_loss(source: TeacherSource, student_state: dict[str, torch.Tensor]) -> float:
    """The loss of the first batch on one process, plain models, the given student weights and the saved teacher."""
    x, y = TOKENS[:2, :-1], TOKENS[:2, 1:]
    plain_student, plain_teacher = GPT(STUDENT), GPT(source.config)  # type: ignore[arg-type]
    plain_student.load_state_dict(student_state, strict=False)
    plain_teacher.load_state_dict(dict(source.load_state()), strict=False)
    with torch.no_grad():
        return distillation_loss(plain_student(x), plain_teacher(x), y, alpha=0.5, temperature=2.0).loss.item()


def fsdp_case(source: TeacherSource, out: Path) -> dict[str, Any]:
    pl.seed_everything(0)
    module = _module(source)
    trainer = _trainer(TrainOptFSDPStrategy(), 2)
    trainer.fit(module, train_dataloaders=_data())
    teacher = module.teacher
    assert teacher is not None
    saved = source.load_state()
    whole = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in teacher.named_parameters()}
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    with torch.no_grad():
        sharded_loss = module.batch_loss((TOKENS[:2, :-1], TOKENS[:2, 1:]))[0].item()
        student_state = {n: p.full_tensor() for n, p in module.model.named_parameters()}
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
        "reference_loss": _reference_loss(source, student_state),
        "checkpoint_teacher_keys": [k for k in saved_keys if k.startswith("teacher.")],
        "checkpoint_student_keys": len([k for k in saved_keys if k.startswith("model.")]),
        "train_kl": float(trainer.callback_metrics["train/kl"]),
    }
    # Resume from that checkpoint (which has no teacher): the student goes on, the teacher is read from its source.
    resumed = _module(source)
    again = _trainer(TrainOptFSDPStrategy(), 3)
    again.fit(resumed, train_dataloaders=_data(), ckpt_path=str(ckpt))
    assert resumed.teacher is not None
    report["resumed_step"] = again.global_step
    report["resumed_teacher_bit_identical"] = all(
        torch.equal(p.full_tensor(), saved[n]) for n, p in resumed.teacher.named_parameters()
    )
    return report


class _Losses(pl.Callback):
    """Each training step's batch, loss and cross-entropy term."""

    def __init__(self) -> None:
        self.loss: list[float] = []
        self.ce: list[float] = []
        self.width = 0  # the widest logits chunk of a step
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self.batches.append((batch[0].clone(), batch[1].clone()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.loss.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
        self.ce.append(float(pl_module.head_loss.last.ce))
        self.width = max(self.width, pl_module.head_loss.last.logits_width)


def _tp_head_gradient(source: TeacherSource, module: DistillGPT, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """For the forward and the reverse KL: the student's head gradient of one batch under TP (vocabulary-parallel
    loss, gathered afterwards) against the gathered version's: one process, the same (gathered) weights, whole head."""
    state = {n: p.full_tensor().detach() for n, p in module.model.named_parameters()}
    whole = _module(source)
    whole.configure_model()
    whole.load_teacher()
    whole.model.load_state_dict(state, strict=False)
    got: dict[str, Any] = {}
    for kind in ("forward", "reverse"):
        module.head_loss.kind = whole.head_loss.kind = kind
        module.zero_grad(set_to_none=True)
        loss, _ = module.batch_loss((x, y))
        loss.backward()
        head = module.model.lm_head.weight
        assert isinstance(head, DTensor)
        assert isinstance(head.grad, DTensor)
        tp_grad = head.grad.full_tensor()
        module.zero_grad(set_to_none=True)
        whole.zero_grad(set_to_none=True)
        want, _ = whole.batch_loss((x, y))
        want.backward()
        grad = whole.model.lm_head.weight.grad
        assert grad is not None
        got[kind] = {
            "loss": float(loss.detach()),
            "want_loss": float(want.detach()),
            "head_grad_max_diff": float((tp_grad - grad).abs().max()),
            "head_grad_max": float(grad.abs().max()),
        }
    module.head_loss.kind = "forward"
    got["whole_logits_width"] = whole.head_loss.last.logits_width
    return {"head_gradient": got}


def tp_case(source: TeacherSource, steps: int = 3) -> dict[str, Any]:
    pl.seed_everything(0)
    module = _module(source)
    losses = _Losses()
    trainer = _trainer(TrainOptTPStrategy(tensor_parallel_size=2), steps, [losses])
    trainer.fit(module, train_dataloaders=_data())
    assert module.teacher is not None
    saved = source.load_state()
    report: dict[str, Any] = {
        "student_dtensor": all(isinstance(p, DTensor) for p in module.model.parameters()),
        # The teacher gets the student's plan: its head sharded over the vocabulary as the student's.
        "teacher_head_placements": [str(p) for p in module.teacher.lm_head.weight.placements],
        "teacher_local_fraction": sum(_local(p).numel() for p in module.teacher.parameters())
        / sum(p.numel() for p in module.teacher.parameters()),
        "teacher_bit_identical": all(
            torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, saved[n])
            for n, p in module.teacher.named_parameters()
        ),
        "teacher_frozen": all(not p.requires_grad and p.grad is None for p in module.teacher.parameters()),
        "tp_loss": losses.loss,
        "tp_ce": losses.ce,
        "tp_logits_width": losses.width,
        "vocab": module.model.lm_head.weight.shape[0],
    }
    report.update(_tp_head_gradient(source, module, *losses.batches[0]))
    # One process, the same seed, the student built eagerly: the run tensor parallelism must reproduce.
    pl.seed_everything(0)
    ref = _module(source)
    ref.configure_model()
    ref.load_teacher()
    optimizer = ref.configure_optimizers()
    report["one_loss"], report["one_ce"] = [], []
    for x, y in losses.batches:  # the batches the fit saw (its sampler's order; both TP ranks read the same)
        loss, _ = ref.batch_loss((x, y))
        report["one_loss"].append(float(loss.detach()))
        report["one_ce"].append(float(ref.head_loss.last.ce))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return report


def tp_hf_case(hf_dir: Path) -> dict[str, Any]:
    import transformers

    source = teacher_source(str(hf_dir / "teacher"))
    student = HFModelConfig(pretrained=str(hf_dir / "student"))
    spec = DistillSpec(source.path, alpha=0.5, temperature=2.0, chunk_tokens=5)
    pl.seed_everything(0)
    module = DistillCausalLM(student, source, spec)
    trainer = _trainer(TrainOptTPStrategy(tensor_parallel_size=2), 2)
    trainer.fit(module, train_dataloaders=_data())
    teacher = module.teacher
    assert teacher is not None
    saved = source.load_state()
    x, y = TOKENS[:2, :-1], TOKENS[:2, 1:]
    with torch.no_grad():
        tp_loss = module.batch_loss((x, y))[0]
        state = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.model.named_parameters()}
    # One process: plain transformers models, the student's trained (gathered) weights, the teacher from its files.
    plain_student = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir / "student"))
    plain_student.load_state_dict(state, strict=False)
    plain_teacher = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir / "teacher"))
    with torch.no_grad():
        want = distillation_loss(plain_student(x).logits, plain_teacher(x).logits, y, alpha=0.5, temperature=2.0)
    return {
        "teacher_head_placements": [str(p) for p in teacher.lm_head.weight.placements],
        "teacher_all_dtensor_matrices": all(isinstance(p, DTensor) for p in teacher.parameters() if p.dim() == 2),
        "teacher_local_fraction": sum(_local(p).numel() for p in teacher.parameters())
        / sum(p.numel() for p in teacher.parameters()),
        "teacher_bit_identical": sorted(n for n, _ in teacher.named_parameters()) == sorted(saved)
        and all(
            torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, saved[n])
            for n, p in teacher.named_parameters()
        ),
        "teacher_frozen": all(not p.requires_grad and p.grad is None for p in teacher.parameters()),
        "teacher_eval": not teacher.training,
        "student_state_loaded": len(state) == len(list(plain_student.parameters())),
        "tp_loss": float(tp_loss.full_tensor() if isinstance(tp_loss, DTensor) else tp_loss),
        "one_loss": float(want.loss),
        "train_kl": float(trainer.callback_metrics["train/kl"]),
        "tp_logits_width": module.head_loss.last.logits_width,
        "vocab": int(teacher.config.vocab_size),
    }


def zero3_case(source: TeacherSource, out: Path) -> dict[str, Any]:
    import deepspeed

    pl.seed_everything(0)
    module = _module(source)
    trainer = _trainer(TrainOptDeepSpeedStrategy(stage=3, preset="zero3"), 2)
    trainer.fit(module, train_dataloaders=_data())
    teacher = module.teacher
    assert teacher is not None
    saved = source.load_state()
    params = list(teacher.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        bit_identical = all(torch.equal(p.detach(), saved[n]) for n, p in params)
    engine_optimizer = trainer.strategy.deepspeed_engine.optimizer  # type: ignore[attr-defined]
    optimized = {id(p) for group in engine_optimizer.fp16_groups for p in group}
    with torch.no_grad():
        sharded_loss = module.batch_loss((TOKENS[:2, :-1], TOKENS[:2, 1:]))[0].item()
    student = list(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in student]):
        student_state = {n: p.detach().clone() for n, p in student}
    ckpt = out / "student_zero3"
    trainer.save_checkpoint(ckpt)
    trainer.strategy.barrier()
    rank = torch.distributed.get_rank()
    files = sorted(ckpt.rglob(f"zero_pp_rank_{rank}_*model_states.pt"))
    states = torch.load(files[0], map_location="cpu", weights_only=False)
    fragments = states.get("frozen_param_fragments") or {}
    report = {
        "teacher_partitioned": all(hasattr(p, "ds_id") for _, p in params),
        "teacher_local_fraction": sum(p.ds_tensor.numel() for _, p in params) / sum(p.ds_numel for _, p in params),
        "teacher_bit_identical": bit_identical,
        "teacher_frozen": all(not p.requires_grad and p.grad is None for _, p in params),
        "teacher_eval": not teacher.training,
        "teacher_in_optimizer": any(id(p) in optimized for _, p in params),
        "student_in_optimizer": len(optimized) == len(student),
        "sharded_loss": sharded_loss,
        "reference_loss": _reference_loss(source, student_state),
        "train_kl": float(trainer.callback_metrics["train/kl"]),
        "checkpoint_teacher_fragments": len([k for k in fragments if k.startswith("teacher.")]),
        "checkpoint_teacher_module_keys": len([k for k in states["module"] if k.startswith("teacher.")]),
        "checkpoint_student_module_keys": len([k for k in states["module"] if k.startswith("model.")]),
        "teacher_tensors": len(params),
    }
    # A checkpoint as written before the teacher was left out: the module saved with it (its module keys and its
    # frozen fragments in DeepSpeed's files).
    legacy = out / "student_zero3_with_teacher"
    module.excluded_from_checkpoint = contextlib.nullcontext  # type: ignore[method-assign]
    trainer.save_checkpoint(legacy)
    del module.excluded_from_checkpoint
    trainer.strategy.barrier()
    states = torch.load(
        sorted(legacy.rglob(f"zero_pp_rank_{rank}_*model_states.pt"))[0], map_location="cpu", weights_only=False
    )
    report["legacy_teacher_module_keys"] = len([k for k in states["module"] if k.startswith("teacher.")])
    report["legacy_teacher_fragments"] = len(
        [k for k in states.get("frozen_param_fragments") or {} if k.startswith("teacher.")]
    )
    # Resume from each: the same step 3 from the same state, so the same student; the teacher as in its files.
    students = {}
    for name, path in (("resumed", ckpt), ("legacy", legacy)):
        _next_process_group()
        resumed = _module(source)
        again = _trainer(TrainOptDeepSpeedStrategy(stage=3, preset="zero3"), 3)
        again.fit(resumed, train_dataloaders=_data(), ckpt_path=str(path))
        assert resumed.teacher is not None
        again_params = list(resumed.teacher.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in again_params]):
            report[f"{name}_teacher_bit_identical"] = all(torch.equal(p.detach(), saved[n]) for n, p in again_params)
        report[f"{name}_step"] = again.global_step
        student = list(resumed.model.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in student]):
            students[name] = {n: p.detach().clone() for n, p in student}
    report["legacy_student_equals_resumed"] = students["legacy"].keys() == students["resumed"].keys() and all(
        torch.equal(students["legacy"][n], p) for n, p in students["resumed"].items()
    )
    moved = [not torch.equal(student_state[n], p) for n, p in students["resumed"].items()]
    report["student_moved_since_save"] = any(moved)
    return report


def main(teacher_path: str, out: Path, hf_dir: Path) -> None:
    source = teacher_source(teacher_path)
    report: dict[str, Any] = {"fsdp": fsdp_case(source, out)}
    _next_process_group()
    report["tp"] = tp_case(source)
    _next_process_group()
    started = time.perf_counter()
    report["tp_hf"] = tp_hf_case(hf_dir)
    report["tp_hf"]["seconds"] = time.perf_counter() - started
    _next_process_group()
    report["zero3"] = zero3_case(source, out)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
