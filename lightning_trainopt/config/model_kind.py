"""Which kind of model a ``model`` node asks for: one of our GPT presets, a Hugging Face config, or your module."""

from __future__ import annotations

from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.exceptions import ConfigError

__all__ = ["ModelKind", "model_kind"]

ModelKind = Literal["gpt", "hf", "module"]
_MISSING = "???"


def model_kind(model: DictConfig | dict[str, Any]) -> ModelKind:
    """``gpt`` (our presets, and a ``model`` node without ``_target_``), ``hf`` or ``module``, from ``_target_``.

    Raises:
        ConfigError: ``model=module`` without ``model._target_``.
    """
    if isinstance(model, DictConfig) and OmegaConf.is_missing(model, "_target_"):
        target: Any = _MISSING
    else:
        target = model.get("_target_")
    if target is None or str(target).endswith("GPTConfig"):
        return "gpt"
    if target == _MISSING:
        raise ConfigError(
            "model._target_",
            _MISSING,
            "model=module needs the class of your LightningModule: model._target_=pkg.module.MyModule "
            "(and its arguments as +model.ARG=...).",
        )
    target = str(target)
    if target.endswith("HFModelConfig"):
        return "hf"
    return "module"
