"""The LightningModule a config asks for: one of our GPT presets, a Hugging Face causal LM, or any LightningModule.

``model``'s ``_target_`` says which: ``GPTConfig`` (``conf/model/gpt_*.yaml``, ``llama_*``), ``HFModelConfig``
(``model=hf``), or the user's own LightningModule class (``model=module model._target_=pkg.MyModule``).
"""

from __future__ import annotations

import types
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from hydra.utils import get_class, instantiate
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import HFModelConfig, LitCausalLM, LitGPT
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.optimization import configure_optimizers

__all__ = [
    "ModelKind",
    "build_lightning_module",
    "count_params",
    "meta_module",
    "model_kind",
    "model_name",
    "model_vocab_size",
    "user_module_class",
]

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


def user_module_class(target: str) -> type[pl.LightningModule]:
    """The LightningModule class ``model._target_`` names.

    Raises:
        ConfigError: it cannot be imported, or is not a LightningModule.
    """
    try:
        cls = get_class(target)
    except Exception as err:  # Hydra wraps the import error; the message names what failed
        raise ConfigError("model._target_", target, f"cannot be imported: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise ConfigError(
            "model._target_", target, "model=module takes a LightningModule class; give the dotted path of one."
        )
    return cls


def _with_app_optimizers(module: pl.LightningModule, cfg: DictConfig) -> pl.LightningModule:
    """Give a module without its own ``configure_optimizers`` the ``optimizer`` and ``scheduler`` groups'."""
    if is_overridden("configure_optimizers", module):
        return module
    optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None

    def app_optimizers(self: pl.LightningModule) -> Any:
        return configure_optimizers(self, optimizer, scheduler)

    module.configure_optimizers = types.MethodType(app_optimizers, module)  # type: ignore[method-assign]
    return module


def build_lightning_module(cfg: DictConfig) -> pl.LightningModule:
    """The LightningModule ``cfg.model`` describes, with the ``optimizer``/``scheduler`` partials, uncompiled.

    ``compile=true`` is applied by ``train.py``'s model rewrite (:mod:`lightning_trainopt.config.rewrite`, step 4 of
    :func:`~lightning_trainopt.parallel.apply.apply_rewrites`), not here.

    Our GPT presets give :class:`~lightning_trainopt.models.LitGPT`, ``model=hf`` a
    :class:`~lightning_trainopt.models.LitCausalLM`; ``model=module`` builds the user's class with the node's other
    keys, and gives it the ``optimizer``/``scheduler`` groups only when it has no ``configure_optimizers`` of its own.
    The inner model of our modules is built later, in ``configure_model`` (inside the strategy's init context).

    Args:
        cfg: the composed config of ``conf/train.yaml`` (or ``conf/plan.yaml``).

    Raises:
        ConfigError: the model node is invalid (a missing file, an unknown override, a class that is not a
            LightningModule).
    """
    kind = model_kind(cfg.model)
    loss = head_loss(cfg)
    if kind == "module":
        if loss is not None:
            raise ConfigError(
                "loss",
                type(loss).__name__,
                "applies to our model presets and model=hf; a LightningModule of yours computes its own loss: use "
                "loss=standard (or call lightning_trainopt.transforms.chunked_loss.ChunkedLMHeadLoss in it).",
            )
        user_module_class(str(cfg.model._target_))
        module = instantiate(cfg.model)
        return _with_app_optimizers(module, cfg)
    optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    spec = instantiate(cfg.model)
    if kind == "hf":
        assert isinstance(spec, HFModelConfig)
        return LitCausalLM(spec, optimizer=optimizer, scheduler=scheduler, loss=loss)
    assert isinstance(spec, GPTConfig)
    return LitGPT(spec, optimizer=optimizer, scheduler=scheduler, loss=loss)


def head_loss(cfg: DictConfig) -> Any:
    """The ``loss`` group's head + cross-entropy callable, or ``None`` for ``loss=standard`` (an empty node).

    Raises:
        ConfigError: a loss that cannot run here (``loss=liger`` without CUDA or Liger-Kernel), from its constructor.
    """
    node = cfg.get("loss")
    if not node or "_target_" not in node:
        return None
    return instantiate(node)


def meta_module(cfg: DictConfig) -> torch.nn.Module:
    """The LightningModule of ``cfg`` with its model built on the ``meta`` device: shapes and dtypes, no memory.

    ``configure_model`` runs under ``torch.device("meta")`` (a user's module that builds its model in ``__init__`` is
    built there too), without ``compile`` and the ``loss`` group: a planner reads parameters and traces the forward
    on fake tensors.

    Args:
        cfg: the composed config of ``conf/train.yaml`` or ``conf/plan.yaml``.
    """
    from omegaconf import open_dict

    uncompiled = cfg.copy()
    with open_dict(uncompiled):
        uncompiled.compile = False
        # The planner counts the loss itself; building it could need this machine to run it (loss=liger: CUDA).
        uncompiled.loss = None
    with torch.device("meta"):
        module = build_lightning_module(uncompiled)
        module.configure_model()
    return module


def count_params(module: torch.nn.Module) -> int:
    """The model's true parameter count: each tensor once (tied weights too), whole under sharding.

    DeepSpeed ZeRO-3 leaves a partitioned placeholder whose true count is ``ds_numel``; an FSDP2 ``DTensor``'s
    ``numel()`` is already the whole tensor's.
    """
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def model_name(cfg: DictConfig, module: torch.nn.Module) -> str:
    """What metrics.json calls the model: the preset name, the Hugging Face ``model_type``, or the class name."""
    if isinstance(module, LitCausalLM):
        return module.model_type
    if isinstance(module, LitGPT):
        return str(cfg.model.get("name") or "gpt")
    return type(module).__name__


def model_vocab_size(module: torch.nn.Module) -> int | None:
    """Token ids the model embeds, when it says: our modules' shapes, else a ``vocab_size`` attribute or hparam."""
    if isinstance(module, LitGPT):
        return module.config.vocab_size
    value = getattr(module, "vocab_size", None)
    if value is None:
        value = getattr(getattr(module, "hparams", {}), "get", lambda _k: None)("vocab_size")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
