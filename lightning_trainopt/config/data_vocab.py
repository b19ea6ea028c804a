"""Vocabularies one config node takes from another: our model's from the token shards' manifest (unless the command
line gives one), and synthetic data's from a Hugging Face model's config."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_trainopt.config.model_factory import model_kind

__all__ = ["TOKENIZED_TARGET", "apply_hf_synthetic_vocab", "apply_manifest_vocab"]

log = logging.getLogger(__name__)

TOKENIZED_TARGET = "lightning_trainopt.data.TokenizedDataModule"
_KEY = "model.vocab_size"
_FROM_MODEL = "${model.vocab_size}"


def _given_on_command_line(key: str) -> bool:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return False
    overrides = HydraConfig.get().overrides.task
    return any(str(o).lstrip("+~").split("=", 1)[0] == key for o in overrides)


def apply_manifest_vocab(cfg: DictConfig) -> int | None:
    """Set ``model.vocab_size`` of one of our model presets to the manifest's, for ``data=tokenized``.

    A preset's ``vocab_size`` (256 for the byte-level presets) is a default, not a choice; the shards' tokenizer
    decides the ids the model must embed. ``model.vocab_size=...`` on the command line wins (a larger, padded
    vocabulary is a common choice). Other model kinds keep theirs: a Hugging Face config's vocabulary is the
    model's, and a smaller one than the data's is refused by the pre-flight check.

    Returns:
        The vocabulary set, or ``None`` when nothing was changed.

    Raises:
        ConfigError: ``data.path`` holds no readable manifest (the manifest reader's error).
    """
    data, model = cfg.get("data"), cfg.get("model")
    if data is None or model is None or str(data.get("_target_", "")) != TOKENIZED_TARGET:
        return None
    if model_kind(model) != "gpt" or _given_on_command_line(_KEY) or not data.get("path"):
        return None
    from lightning_trainopt.data.manifest import Manifest

    vocab: Any = Manifest.read(str(data.path)).vocab_size
    if model.get("vocab_size") == vocab:
        return None
    with open_dict(model):
        model.vocab_size = int(vocab)
    log.info(
        "model.vocab_size=%d from %s/manifest.json (give model.vocab_size=... to choose another)", vocab, data.path
    )
    return int(vocab)


def apply_hf_synthetic_vocab(cfg: DictConfig) -> int | None:
    """Give ``data=synthetic`` a Hugging Face model's vocabulary: ``model=hf ... data=synthetic`` must just run.

    The synthetic data's default ``data.vocab_size`` is ``${model.vocab_size}``, which our presets define; a Hugging
    Face model's vocabulary is in its ``config.json`` (after ``model.overrides``), not in the ``model`` node. Only that
    default is filled in; a ``data.vocab_size`` given on the command line is kept (and checked against the model's).

    Returns:
        The vocabulary set, or ``None`` when nothing was changed.

    Raises:
        ConfigError: the model's config cannot be read (its reader's error, naming the key).
    """
    data, model = cfg.get("data"), cfg.get("model")
    if data is None or model is None or data.get("corpus") != "synthetic" or model_kind(model) != "hf":
        return None
    raw = OmegaConf.to_container(data, resolve=False)
    if not isinstance(raw, dict) or raw.get("vocab_size") != _FROM_MODEL or "vocab_size" in model:
        return None
    from hydra.utils import instantiate

    vocab = getattr(instantiate(model).load(), "vocab_size", None)
    if not isinstance(vocab, int):
        return None  # validation names data.vocab_size and asks for a number
    with open_dict(data):
        data.vocab_size = vocab
    log.info("data.vocab_size=%d: the Hugging Face model's vocabulary (data.vocab_size=N chooses another)", vocab)
    return vocab
