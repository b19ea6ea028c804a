"""Where a distillation teacher comes from (``distill.teacher``): one of our checkpoints or a Hugging Face directory.

Resolved once, before training: the teacher's shape (the checkpoint's own hyper-parameters, the directory's
``config.json``, or ``distill.teacher_model``), a fingerprint of its files, and a loader of its whole state dict that
the distilling module calls once its teacher is placed (:class:`~lightning_trainopt.models.distill.TeacherSource`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_trainopt.checkpoint.convert import read_checkpoint_weights
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.distill import TeacherSource
from lightning_trainopt.models.hf_config import HFModelConfig

__all__ = ["fingerprint", "teacher_source"]

_KEY = "distill.teacher"
_EDGE = 1 << 20  # bytes hashed at each end of each file


def fingerprint(path: str | os.PathLike[str]) -> str:
    """A SHA-256 of the teacher's files: each file's name, size and its first and last MiB.

    Cheap for a large teacher (a full hash would read every byte once more) and still changes when the weights are
    retrained or replaced; it is recorded in the student's checkpoints and compared on resume.
    """
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}:{size}\n".encode())
        with file.open("rb") as f:
            digest.update(f.read(_EDGE))
            if size > 2 * _EDGE:
                f.seek(size - _EDGE)
                digest.update(f.read(_EDGE))
    return digest.hexdigest()


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _shape(hyper: Mapping[str, Any], given: GPTConfig | HFModelConfig | None, path: str) -> GPTConfig | HFModelConfig:
    if given is not None:
        return given
    model = hyper.get("model")
    if isinstance(model, Mapping):
        fields = dict(model)
        if "n_layers" in fields and "d_model" in fields:
            return GPTConfig(**fields)
        if "config" in fields or "pretrained" in fields:
            return HFModelConfig(**fields)
    raise ConfigError(
        _KEY,
        path,
        "the checkpoint does not say the teacher's model (no model hyper-parameters); give it as "
        "distill.teacher_model (e.g. +distill.teacher_model=${model} of the teacher's run, with its _target_).",
    )


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    from lightning_trainopt.models.hf import _read_tensor, _saved_tensors

    return {name: _read_tensor(file, name) for name, file in _saved_tensors(path).items()}


def teacher_source(path: str, teacher_model: GPTConfig | HFModelConfig | None = None) -> TeacherSource:
    """Resolve ``distill.teacher`` (and ``distill.teacher_model``) into a :class:`TeacherSource`.

    Raises:
        ConfigError: no such file or directory, a directory that is neither a checkpoint nor a Hugging Face model
            directory, or a checkpoint that does not say its model.
    """
    where = Path(path).expanduser()
    if not where.exists():
        raise ConfigError(
            _KEY,
            path,
            "no such file or directory; give a checkpoint of a run (e.g. outputs/.../checkpoints/last.ckpt) or a "
            "local Hugging Face model directory (config.json + safetensors); nothing is downloaded.",
        )
    if _is_hf_dir(where):
        config: GPTConfig | HFModelConfig = teacher_model or HFModelConfig(pretrained=str(where))
        if isinstance(config, HFModelConfig):
            config.weights_dir()  # refuses a directory without weights, naming model.pretrained
            vocab = int(config.load().vocab_size)
        else:
            vocab = config.vocab_size
        return TeacherSource(str(path), config, fingerprint(where), lambda: _hf_state(where), vocab)
    state, hyper = read_checkpoint_weights(where)
    if any(".lora_A." in key for key in state):
        # The teacher is a plain model: an adapter run's checkpoint holds its adapters beside (mostly without) the
        # frozen base, which failed later as "20 missing / 28 unexpected tensors" naming distill.teacher_model.
        raise ConfigError(
            _KEY,
            path,
            "a checkpoint of an adapter=lora|qlora run (it holds LoRA tensors, and leaves its frozen base out); "
            f"merge the adapter into its base first, trainopt-export {path} --out DIR --format hf, then give "
            "distill.teacher=DIR.",
        )
    config = _shape(hyper, teacher_model, path)
    vocab = config.vocab_size if isinstance(config, GPTConfig) else int(config.load().vocab_size)
    weights = {k: v for k, v in state.items() if not k.startswith("teacher.")}  # a distilled run's own teacher
    return TeacherSource(str(path), config, fingerprint(where), lambda: weights, vocab)
