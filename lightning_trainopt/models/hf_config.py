"""Where a Hugging Face causal LM comes from: a local ``config.json``, optional local weights, field overrides."""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_trainopt.exceptions import ConfigError, MissingDependencyError

__all__ = ["ATTN_IMPLEMENTATIONS", "HFModelConfig", "import_transformers"]

#: ``model.attn_implementation`` values: torch's fused attention, the plain matmul version, flash-attn's kernels.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
# File names Hugging Face's from_pretrained loads weights from (single file or sharded with an index).
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def import_transformers() -> Any:
    """``transformers``, imported in offline mode, so that a missing file never turns into a download.

    Raises:
        MissingDependencyError: transformers is not installed (naming the ``hf`` extra).
    """
    # huggingface_hub reads these when it is first imported; set before, and kept for the ranks Lightning starts.
    os.environ.update(_OFFLINE)
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise MissingDependencyError("transformers", "hf", "model=hf") from err


def _config_file(key: str, path: str) -> Path:
    """The ``config.json`` that ``path`` names (the file, or a directory holding it)."""
    given = Path(path).expanduser()
    if given.is_dir():
        given = given / "config.json"
        if not given.is_file():
            raise ConfigError(key, path, "the directory holds no config.json; point it at a model directory or file.")
        return given
    if given.is_file():
        return given
    raise ConfigError(
        key,
        path,
        "no such local file or directory (train.py never downloads: a hub name is refused); give the path of a "
        "config.json or of a directory holding one, e.g. one saved by save_pretrained or huggingface-cli download.",
    )


@dataclass(frozen=True)
class HFModelConfig:
    """A Hugging Face causal LM built from local files only (``conf/model/hf.yaml``).

    Args:
        config: a ``config.json`` or a directory holding one; ``None`` takes ``pretrained``'s.
        pretrained: a local directory with the weights to load (``from_pretrained(local_files_only=True)``);
            ``None`` initialises the model from ``config``.
        overrides: config fields to change, e.g. ``{"num_hidden_layers": 2}``.
        attn_implementation: ``sdpa``, ``eager`` or ``flash_attention_2`` (CUDA and the flash-attn package).

    Example::

        spec = HFModelConfig(config="tiny_llama/config.json", overrides={"num_hidden_layers": 2})
        hf_config = spec.load()
    """

    config: str | None = None
    pretrained: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "sdpa"

    def config_file(self) -> Path:
        """The ``config.json`` to build from (checked to exist).

        Raises:
            ConfigError: neither key given, or a path that does not exist locally.
        """
        if self.config is not None:
            return _config_file("model.config", self.config)
        if self.pretrained is not None:
            return _config_file("model.pretrained", self.pretrained)
        raise ConfigError(
            "model.config",
            None,
            "model=hf needs model.config=PATH (a config.json or its directory) or model.pretrained=DIR.",
        )

    def weights_dir(self) -> Path | None:
        """The directory to load weights from, or ``None`` for a model initialised from its config.

        Raises:
            ConfigError: not a local directory, or one with no weight file.
        """
        if self.pretrained is None:
            return None
        path = Path(self.pretrained).expanduser()
        if not path.is_dir():
            raise ConfigError(
                "model.pretrained",
                self.pretrained,
                "no such local directory (train.py never downloads: a hub name is refused); give a directory saved "
                "by save_pretrained, or leave model.pretrained null to initialise from model.config.",
            )
        if not any((path / name).is_file() for name in _WEIGHT_FILES):
            raise ConfigError(
                "model.pretrained",
                self.pretrained,
                f"the directory holds no weights ({', '.join(_WEIGHT_FILES)}); point it at a directory with them, "
                "or leave model.pretrained null to initialise the model from model.config.",
            )
        return path

    def check_attention(self, accelerator: str) -> None:
        """Refuse an attention kernel this machine cannot run.

        Args:
            accelerator: ``cpu`` or ``gpu``, as the trainer resolves it.

        Raises:
            ConfigError: an unknown value, or ``flash_attention_2`` on CPU.
            MissingDependencyError: ``flash_attention_2`` without the flash-attn package.
        """
        value = self.attn_implementation
        if value not in ATTN_IMPLEMENTATIONS:
            raise ConfigError("model.attn_implementation", value, f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}.")
        if value != "flash_attention_2":
            return
        if accelerator == "cpu":
            raise ConfigError(
                "model.attn_implementation",
                value,
                "flash-attn runs on CUDA GPUs only; use model.attn_implementation=sdpa on CPU "
                '(on a GPU machine install it with the gpu extra: pip install -e ".[gpu]").',
            )
        try:
            importlib.import_module("flash_attn")
        except ImportError as err:
            raise MissingDependencyError("flash_attn", "gpu", "model.attn_implementation=flash_attention_2") from err

    def load(self) -> Any:
        """The ``PretrainedConfig`` with the overrides applied, read from local files only.

        Raises:
            ConfigError: a missing file, or an override that is not a field of the model's config (with the nearest).
        """
        transformers = import_transformers()
        path = self.config_file()
        try:
            hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            key = "model.config" if self.config is not None else "model.pretrained"
            raise ConfigError(key, str(path), f"not a Hugging Face model config ({err}).") from err
        known = set(hf_config.to_dict()) | set(getattr(hf_config, "attribute_map", {}))
        for name, value in (self.overrides or {}).items():
            if name not in known:
                close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.6)
                hint = f"did you mean model.overrides.{close[0]}?" if close else "see the model's config.json."
                raise ConfigError(
                    f"model.overrides.{name}", value, f"not a field of {type(hf_config).__name__}; {hint}"
                )
            setattr(hf_config, str(name), value)
        return hf_config
