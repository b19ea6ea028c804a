"""The LightningModule a config asks for: one of our GPT presets, a Hugging Face causal LM, or any LightningModule.

``model``'s ``_target_`` says which: ``GPTConfig`` (``conf/model/gpt_*.yaml``, ``llama_*``), ``HFModelConfig``
(``model=hf``), or the user's own LightningModule class (``model=module model._target_=pkg.MyModule``).
"""

from __future__ import annotations

import types
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import get_class, instantiate
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig

from lightning_trainopt.config.model_kind import ModelKind, model_kind
from lightning_trainopt.config.run_spec import ModelSpec, OptimizerSpec, model_spec, optimizer_spec
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.adapter_accounting import param_count
from lightning_trainopt.models import HFModelConfig, LitCausalLM, LitGPT
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.optimization import configure_optimizers

__all__ = [
    "ModelKind",
    "build_lightning_module",
    "build_module",
    "count_params",
    "meta_module",
    "meta_module_of",
    "model_kind",
    "model_name",
    "model_vocab_size",
    "user_module_class",
]


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


def _partial(node: dict[str, Any] | None) -> Any:
    """An ``optimizer``/``scheduler`` partial built from its plain node (``None`` without one)."""
    return instantiate(node, _convert_="all") if node else None


def _with_app_optimizers(module: pl.LightningModule, optimizer: OptimizerSpec) -> pl.LightningModule:
    """Give a module without its own ``configure_optimizers`` the ``optimizer`` and ``scheduler`` groups'."""
    if is_overridden("configure_optimizers", module):
        return module
    partial, scheduler = _partial(optimizer.node), _partial(optimizer.scheduler)

    def app_optimizers(self: pl.LightningModule) -> Any:
        return configure_optimizers(self, partial, scheduler)

    module.configure_optimizers = types.MethodType(app_optimizers, module)  # type: ignore[method-assign]
    return module


def build_lightning_module(cfg: DictConfig) -> pl.LightningModule:
    """:func:`build_module` of a composed config's ``model``, ``loss``, ``optimizer`` and ``scheduler`` groups.

    Args:
        cfg: the composed config of ``conf/train.yaml`` (or ``conf/plan.yaml``).

    Raises:
        ConfigError: see :func:`build_module`.
    """
    return build_module(model_spec(cfg), optimizer_spec(cfg))


def build_module(model: ModelSpec, optimizer: OptimizerSpec, tensor_parallel: int = 1) -> pl.LightningModule:
    """The LightningModule ``model`` describes, with the ``optimizer``/``scheduler`` partials, uncompiled.

    ``compile=true`` is applied by ``train.py``'s model rewrite (:mod:`lightning_trainopt.config.rewrite`, step 4 of
    :func:`~lightning_trainopt.parallel.apply.apply_rewrites`), not here.

    Our GPT presets give :class:`~lightning_trainopt.models.LitGPT`, ``model=hf`` a
    :class:`~lightning_trainopt.models.LitCausalLM`; ``model=module`` builds the user's class with the node's other
    keys (as plain dicts and lists), and gives it the ``optimizer``/``scheduler`` groups only when it has no
    ``configure_optimizers`` of its own. The inner model of our modules is built later, in ``configure_model`` (inside
    the strategy's init context).

    Args:
        model: the run spec's model section (with the ``loss`` group).
        optimizer: the run spec's optimizer section (with the ``scheduler`` group).
        tensor_parallel: the run's tensor-parallel size: a distillation teacher it cannot split is refused here.

    Raises:
        ConfigError: the model node is invalid (a missing file, an unknown override, a class that is not a
            LightningModule), or a loss that cannot run here (``loss=liger`` without CUDA), from its constructor.
    """
    if model.distill is not None:
        from lightning_trainopt.config.distill import build_distill_module

        return build_distill_module(model, optimizer, tensor_parallel)
    loss = instantiate(model.loss, _convert_="all") if model.loss else None
    if model.kind == "module":
        if loss is not None:
            raise ConfigError(
                "loss",
                type(loss).__name__,
                "applies to our model presets and model=hf; a LightningModule of yours computes its own loss: use "
                "loss=standard (or call lightning_trainopt.transforms.chunked_loss.ChunkedLMHeadLoss in it).",
            )
        user_module_class(str(model.node["_target_"]))
        module = instantiate(model.node, _convert_="all")
        return _with_app_optimizers(module, optimizer)
    partial, scheduler = _partial(optimizer.node), _partial(optimizer.scheduler)
    spec = instantiate(model.node, _convert_="all")
    if model.kind == "hf":
        assert isinstance(spec, HFModelConfig)
        return LitCausalLM(spec, optimizer=partial, scheduler=scheduler, loss=loss)
    assert isinstance(spec, GPTConfig)
    return LitGPT(spec, optimizer=partial, scheduler=scheduler, loss=loss)


def meta_module(cfg: DictConfig) -> torch.nn.Module:
    """:func:`meta_module_of` a composed config (``conf/train.yaml`` or ``conf/plan.yaml``)."""
    return meta_module_of(model_spec(cfg), optimizer_spec(cfg))


def meta_module_of(model: ModelSpec, optimizer: OptimizerSpec) -> torch.nn.Module:
    """The LightningModule of ``model`` with its model built on the ``meta`` device: shapes and dtypes, no memory.

    ``configure_model`` runs under ``torch.device("meta")`` (a user's module that builds its model in ``__init__`` is
    built there too), without ``compile`` and the ``loss`` group: a planner reads parameters and traces the forward
    on fake tensors.
    """
    # The planner counts the loss itself; building it could need this machine to run it (loss=liger: CUDA).
    with torch.device("meta"):
        # The student alone: the planner counts a distillation teacher itself.
        module = build_module(replace(model, loss=None, distill=None), optimizer)
        module.configure_model()
    return module


def count_params(module: torch.nn.Module) -> int:
    """The model's true parameter count: each tensor once (tied weights too), whole under sharding.

    DeepSpeed ZeRO-3 leaves a partitioned placeholder whose true count is ``ds_numel``; an FSDP2 ``DTensor``'s
    ``numel()`` is already the whole tensor's; a QLoRA 4-bit weight counts its original shape, not its packed storage.
    """
    return sum(param_count(p) for p in module.parameters())


def count_trainable_params(module: torch.nn.Module) -> int:
    """The parameters that get gradients (with an adapter: the adapters only), counted as :func:`count_params` does."""
    return sum(param_count(p) for p in module.parameters() if p.requires_grad)


def model_name(preset: str | None, module: torch.nn.Module) -> str:
    """What metrics.json calls the model: the preset's ``model.name``, the Hugging Face ``model_type``, or the class
    name."""
    if isinstance(module, LitCausalLM):
        return module.model_type
    if isinstance(module, LitGPT):
        return preset or "gpt"
    return type(module).__name__


def model_vocab_size(module: torch.nn.Module) -> int | None:
    """Token ids the model embeds, when it says: our modules' shapes, else a ``vocab_size`` attribute or hparam."""
    if isinstance(module, LitGPT):
        return module.config.vocab_size
    value = getattr(module, "vocab_size", None)
    if value is None:
        value = getattr(getattr(module, "hparams", {}), "get", lambda _k: None)("vocab_size")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
