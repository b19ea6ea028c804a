"""fp32-kept modules (the design articles' "SafeLayer"): a module that runs in fp32 with autocast off.

The module's ``forward`` is replaced on the instance, so its class, parameter names, state-dict keys and hooks stay
as they were (checkpoints load with or without it), and the replacement runs after every forward pre-hook: DeepSpeed
ZeRO-3 and FSDP2 have gathered the parameters by then.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from lightning_trainopt._compat.torch_internals import reparametrized

__all__ = ["is_kept_fp32", "keep_in_fp32"]

_ORIGINAL_FORWARD = "_trainopt_fp32_original_forward"


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def _device_type(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    first = next(module.parameters(), None)
    return "cpu" if first is None else first.device.type


def is_kept_fp32(module: nn.Module) -> bool:
    """``module`` runs in fp32 through :func:`keep_in_fp32`."""
    return _ORIGINAL_FORWARD in module.__dict__


def keep_in_fp32(module: nn.Module) -> None:
    """Make ``module`` compute in fp32 whatever precision surrounds it. Idempotent.

    Floating-point inputs are cast to fp32 and autocast is off inside the module (so bf16 autocast, Transformer
    Engine's ``fp8_autocast`` region and torchao's FP8 layers around it do not reach in; its own sub-modules are
    never converted to FP8). Parameters held in half precision (DeepSpeed's bf16 mode casts every parameter) are
    used through an fp32 copy made in the forward, so the arithmetic is fp32 and the gradient flows back to the
    half-precision parameter. The output is fp32.
    """
    if is_kept_fp32(module):
        return
    module.__dict__[_ORIGINAL_FORWARD] = module.forward
    # Bound to the instance (no closure over it), so a deep copy of the module runs its own copy.
    module.forward = types.MethodType(_fp32_forward, module)  # type: ignore[method-assign]


def _fp32_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = self.__dict__[_ORIGINAL_FORWARD]
    device_type = _device_type(self, args, kwargs)
    args, kwargs = _to_fp32(args), _to_fp32(kwargs)
    with torch.autocast(device_type, enabled=False):
        half = {
            name: p.float() for name, p in self.named_parameters() if p.is_floating_point() and p.dtype != torch.float32
        }
        if not half:
            return original(*args, **kwargs)
        with reparametrized(self, half):
            return original(*args, **kwargs)
