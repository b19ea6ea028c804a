"""Optimizer factories for ``conf/optimizer/*.yaml`` (Hydra partials called as ``optimizer(param_groups)``).

The per-optimizer names (``bnb_lion8bit``, ``torchao_adamw4bit``, ...) keep the library and the variant in the
``_target_`` string, which the planner reads to pick its optimizer-state model.

bitsandbytes and torchao are imported only when their optimizer is built; a missing package raises
:class:`~lightning_trainopt.exceptions.MissingDependencyError` naming the pip extra.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

from lightning_trainopt.exceptions import ConfigError, MissingDependencyError

__all__ = [
    "BITSANDBYTES_OPTIMIZERS",
    "TORCHAO_OPTIMIZERS",
    "adamw",
    "bitsandbytes_optimizer",
    "bnb_adam8bit",
    "bnb_adamw8bit",
    "bnb_lion8bit",
    "bnb_paged_adamw8bit",
    "fused_adam_kwargs",
    "torchao_adamw4bit",
    "torchao_adamw8bit",
    "torchao_optimizer",
]

#: bitsandbytes classes we expose, with the keyword arguments of ours that each accepts.
BITSANDBYTES_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "AdamW8bit": ("lr", "betas", "eps", "weight_decay", "min_8bit_size"),
    "Adam8bit": ("lr", "betas", "eps", "weight_decay", "min_8bit_size"),
    "PagedAdamW8bit": ("lr", "betas", "eps", "weight_decay", "min_8bit_size"),
    "Lion8bit": ("lr", "betas", "weight_decay", "min_8bit_size"),
}
#: torchao low-bit AdamW classes we expose.
TORCHAO_OPTIMIZERS: tuple[str, ...] = ("AdamW8bit", "AdamW4bit")


def _materialise(params: Iterable[Any]) -> list[Any]:
    return list(params)


def _all_cuda(groups: list[Any]) -> bool:
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return bool(tensors) and all(t.is_cuda and t.is_floating_point() for t in tensors)


def adamw(
    params: Iterable[Any],
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """torch AdamW; ``fused=None`` picks the fused kernel when every parameter is a CUDA float tensor.

    Raises:
        ConfigError: ``fused=True`` with parameters that are not all on CUDA.
    """
    groups = _materialise(params)
    if fused is None:
        fused = _all_cuda(groups)
    elif fused and not _all_cuda(groups):
        raise ConfigError("optimizer.fused", fused, "the fused AdamW kernel needs CUDA parameters; use fused=null.")
    b1, b2 = betas
    return torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay, fused=fused)


def fused_adam_kwargs(
    factory: Any, params: Iterable[torch.Tensor], precision: str, gradient_clip_val: float | None, deepspeed: bool
) -> dict[str, Any]:
    """``{"fused": True}`` when a torch Adam/AdamW factory may take the fused CUDA kernel, else ``{}``.

    The fused kernel updates every parameter in one launch per step instead of a few per tensor. It is chosen
    only where it is safe: a Hydra partial of ``torch.optim.Adam``/``AdamW`` that sets neither ``fused`` nor
    ``foreach``, every parameter a floating-point CUDA tensor, not under DeepSpeed (which runs its own optimizer
    step on flat partitions), and not fp16 AMP with gradient clipping: a fused optimizer unscales inside its step,
    so Lightning refuses to clip its gradients ("does not allow for gradient clipping").
    """
    func = getattr(factory, "func", None)
    keywords = getattr(factory, "keywords", {}) or {}
    if func not in (torch.optim.Adam, torch.optim.AdamW) or "fused" in keywords or "foreach" in keywords:
        return {}
    if deepspeed or (precision == "16-mixed" and gradient_clip_val):
        return {}
    tensors = list(params)
    if not tensors or not all(t.is_cuda and t.is_floating_point() for t in tensors):
        return {}
    return {"fused": True}


def _import(module: str, extra: str, feature: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(module.split(".")[0], extra, feature) from err


def bitsandbytes_optimizer(params: Iterable[Any], name: str = "AdamW8bit", **kwargs: Any) -> torch.optim.Optimizer:
    """A bitsandbytes 8-bit optimizer by class name (runs on CPU tensors too).

    Tensors below ``min_8bit_size`` elements (default 4096) keep fp32 states: measure the mix with
    :func:`~lightning_trainopt.transforms.optimizer_state_bytes`.

    Raises:
        ConfigError: unknown ``name`` or a keyword the class does not take.
        MissingDependencyError: bitsandbytes is not installed.
    """
    if name not in BITSANDBYTES_OPTIMIZERS:
        raise ConfigError("optimizer.name", name, f"use one of {sorted(BITSANDBYTES_OPTIMIZERS)}.")
    allowed = BITSANDBYTES_OPTIMIZERS[name]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ConfigError(
            f"optimizer.{unknown[0]}", kwargs[unknown[0]], f"bitsandbytes {name} takes only {list(allowed)}."
        )
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    bnb_optim = _import("bitsandbytes.optim", "bnb", f"optimizer {name}")
    return getattr(bnb_optim, name)(_materialise(params), **kwargs)


def torchao_optimizer(params: Iterable[Any], name: str = "AdamW8bit", **kwargs: Any) -> torch.optim.Optimizer:
    """torchao's 8-bit or 4-bit AdamW (block-wise quantised states, CPU and CUDA).

    Raises:
        ConfigError: unknown ``name``.
        MissingDependencyError: torchao is not installed.
    """
    if name not in TORCHAO_OPTIMIZERS:
        raise ConfigError("optimizer.name", name, f"use one of {list(TORCHAO_OPTIMIZERS)}.")
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    ao_optim = _import("torchao.optim", "torchao", f"optimizer torchao {name}")
    return getattr(ao_optim, name)(_materialise(params), **kwargs)


def bnb_adamw8bit(params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """bitsandbytes ``AdamW8bit`` (``conf/optimizer/adamw8bit.yaml``)."""
    return bitsandbytes_optimizer(params, name="AdamW8bit", **kwargs)


def bnb_adam8bit(params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """bitsandbytes ``Adam8bit`` (``conf/optimizer/adam8bit.yaml``)."""
    return bitsandbytes_optimizer(params, name="Adam8bit", **kwargs)


def bnb_paged_adamw8bit(params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """bitsandbytes ``PagedAdamW8bit`` (``conf/optimizer/paged_adamw8bit.yaml``)."""
    return bitsandbytes_optimizer(params, name="PagedAdamW8bit", **kwargs)


def bnb_lion8bit(params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """bitsandbytes ``Lion8bit`` (``conf/optimizer/lion8bit.yaml``)."""
    return bitsandbytes_optimizer(params, name="Lion8bit", **kwargs)


def torchao_adamw8bit(params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """torchao ``AdamW8bit`` (``conf/optimizer/adamw8bit_torchao.yaml``)."""
    return torchao_optimizer(params, name="AdamW8bit", **kwargs)


def torchao_adamw4bit(params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """torchao ``AdamW4bit`` (``conf/optimizer/adamw4bit_torchao.yaml``)."""
    return torchao_optimizer(params, name="AdamW4bit", **kwargs)
