"""Our model's vocabulary from the token shards' manifest, unless the command line gives one."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, open_dict

from lightning_trainopt.config.model_factory import model_kind

__all__ = ["TOKENIZED_TARGET", "apply_manifest_vocab"]

log = logging.getLogger(__name__)

TOKENIZED_TARGET = "lightning_trainopt.data.TokenizedDataModule"
_KEY = "model.vocab_size"


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
