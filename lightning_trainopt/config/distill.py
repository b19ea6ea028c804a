"""``experiment=distill``: the student of ``model=...`` and the teacher of ``distill.teacher``, checked and built.

The student is built from the same nodes as any run; the teacher is resolved before anything is built
(:func:`~lightning_trainopt.checkpoint.teacher.teacher_source`) and the two vocabularies are compared: their sizes,
and, where both come with a tokenizer, the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate

from lightning_trainopt.checkpoint.teacher import teacher_source
from lightning_trainopt.config.run_spec import ModelSpec, OptimizerSpec
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.distill import (
    DistillCausalLM,
    DistillGPT,
    DistillSpec,
    TeacherSource,
    build_teacher_model,
)
from lightning_trainopt.models.hf_config import HFModelConfig, import_transformers
from lightning_trainopt.parallel.tp import check_teacher_tensor_parallel as _check_split

__all__ = ["build_distill_module", "check_teacher_tensor_parallel", "check_teacher_vocab"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _tokenizer_dir(config: GPTConfig | HFModelConfig) -> Path | None:
    """The local directory of a Hugging Face model's tokenizer, when it has one (our GPT presets are byte-level)."""
    if not isinstance(config, HFModelConfig):
        return None
    for value in (config.pretrained, config.config):
        if value is None:
            continue
        path = Path(value).expanduser()
        path = path if path.is_dir() else path.parent
        if any((path / name).is_file() for name in _TOKENIZER_FILES):
            return path
    return None


def check_teacher_vocab(student: GPTConfig | HFModelConfig, student_vocab: int, teacher: TeacherSource) -> None:
    """Refuse a teacher whose vocabulary is not the student's: a different size, or different tokens.

    Raises:
        ConfigError: naming ``distill.teacher``, what differs and how to make them agree.
    """
    student_key = "model.vocab_size" if isinstance(student, GPTConfig) else "model.overrides.vocab_size"
    if teacher.vocab_size != student_vocab:
        raise ConfigError(
            "distill.teacher",
            teacher.path,
            f"the teacher's vocabulary has {teacher.vocab_size} token ids, the student's {student_vocab}: the KL term "
            f"compares the two models' distributions over the same token ids. Use a student with the teacher's "
            f"tokenizer ({student_key}={teacher.vocab_size} and data tokenized the same way), or a teacher trained "
            "on the student's tokenizer.",
        )
    mine, theirs = _tokenizer_dir(student), _tokenizer_dir(teacher.config)
    if mine is None or theirs is None:
        return
    auto = import_transformers().AutoTokenizer
    a = auto.from_pretrained(str(mine), local_files_only=True).get_vocab()
    b = auto.from_pretrained(str(theirs), local_files_only=True).get_vocab()
    differ = sorted(t for t in set(a) | set(b) if a.get(t) != b.get(t))
    if differ:
        shown = ", ".join(f"{t!r}: student {a.get(t)} / teacher {b.get(t)}" for t in differ[:3])
        raise ConfigError(
            "distill.teacher",
            teacher.path,
            f"the two tokenizers give {len(differ)} token(s) different ids ({shown}); the KL term needs the same "
            f"token behind each id: use the teacher's tokenizer for the student (copy it into {mine}) or a teacher "
            "trained with the student's.",
        )


def check_teacher_tensor_parallel(config: GPTConfig | HFModelConfig, path: str, tensor_parallel: int) -> None:
    """Refuse, before anything is spawned, a teacher the student's tensor-parallel plan cannot split.

    The teacher is built on the meta device from its shape ``config`` (our checkpoint's model hyper-parameters, a HF
    directory's ``config.json``, or ``distill.teacher_model``) and checked by the rule the TP step of the ordered
    rewrite applies (:func:`~lightning_trainopt.parallel.tp.check_teacher_tensor_parallel`). ``train.py`` calls it
    when it builds the module, ``plan.py`` for the teacher it plans; ``path`` is ``distill.teacher``.

    Raises:
        IncompatibleConfigError: naming ``distill.teacher`` and ``strategy.tensor_parallel_size``.
    """
    if tensor_parallel <= 1:
        return
    with torch.device("meta"):
        model = build_teacher_model(config)
    _check_split(model, tensor_parallel, path)


def build_distill_module(model: ModelSpec, optimizer: OptimizerSpec, tensor_parallel: int = 1) -> pl.LightningModule:
    """The distilling LightningModule of ``model`` (the student) and ``model.distill`` (the teacher and the loss).

    Raises:
        ConfigError: a ``loss`` group other than ``standard`` (distillation computes its own chunked loss),
            ``model=module`` (a user's module computes its own loss), a teacher that cannot be read, or vocabularies
            that differ.
        IncompatibleConfigError: a teacher ``tensor_parallel`` cannot split (:func:`check_teacher_tensor_parallel`).
    """
    assert model.distill is not None
    if model.loss is not None:
        raise ConfigError(
            "loss",
            str(model.loss.get("_target_")),
            "experiment=distill computes the head and the loss chunk by chunk itself (distill.chunk_tokens); use "
            "loss=standard.",
        )
    if model.kind == "module":
        raise ConfigError(
            "model",
            str(model.node.get("_target_")),
            "experiment=distill trains one of our presets (model=gpt_*) or model=hf as the student; a LightningModule "
            "of yours can call lightning_trainopt.transforms.distill_loss.chunked_distillation_loss itself.",
        )
    spec = instantiate(model.distill, _convert_="all")
    if not isinstance(spec, DistillSpec):
        raise ConfigError(
            "distill._target_", type(spec).__name__, "use experiment=distill (conf/distill/default.yaml)."
        )
    source = teacher_source(spec.teacher, spec.teacher_model)
    check_teacher_tensor_parallel(source.config, source.path, tensor_parallel)
    partial = instantiate(optimizer.node, _convert_="all") if optimizer.node else None
    scheduler = instantiate(optimizer.scheduler, _convert_="all") if optimizer.scheduler else None
    student: Any = instantiate(model.node, _convert_="all")
    if isinstance(student, HFModelConfig):
        module = DistillCausalLM(student, source, spec, optimizer=partial, scheduler=scheduler)
        check_teacher_vocab(student, module.vocab_size, source)
        return module
    assert isinstance(student, GPTConfig)
    check_teacher_vocab(student, student.vocab_size, source)
    return DistillGPT(student, source, spec, optimizer=partial, scheduler=scheduler)
