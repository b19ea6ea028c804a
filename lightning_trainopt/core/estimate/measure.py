"""The generic activation estimate: bytes saved for backward by any ``nn.Module``, measured without memory.

The module is built and run under ``FakeTensorMode`` (tensors have shapes, dtypes and storages but no data), and
:class:`~lightning_trainopt.core.saved_tensors.SavedTensorsCounter` — the project's one measurement — counts what
autograd keeps. Fake CPU tensors dispatch to the same kernels as real ones (SDPA picks its flash kernel), so the
figure equals a real CPU forward's to the byte; a 7B model is measured on a laptop in seconds. On the ``meta``
device SDPA would fall back to the math kernel and count the T x T scores, which is why fake tensors are used.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_trainopt.core.saved_tensors import SavedTensorsCounter

__all__ = ["measure_activation_bytes"]


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, dict):
        return _default_loss(next(iter(out.values())))
    return _default_loss(out[0])


def measure_activation_bytes(
    build_module: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Any, ...]],
    loss_fn: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Bytes saved for backward by one forward (and loss) of a module, measured on fake tensors.

    Args:
        build_module: returns the module; called inside ``FakeTensorMode`` so its parameters take no memory.
        make_inputs: returns the forward's positional inputs; also called inside the fake mode.
        loss_fn: ``(module, inputs) -> loss``; default: the module's first output, summed in fp32.
        autocast_dtype: run the forward under CPU autocast to this dtype (Lightning's ``*-mixed``).

    Returns:
        Activation bytes (parameters and their views excluded, each storage once).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        # The counter asks storages for their address; fake storages answer with a deprecation warning.
        warnings.simplefilter("ignore")
        with FakeTensorMode():
            module = build_module()
            inputs = make_inputs()
            with SavedTensorsCounter(params=module.parameters()) as counter:
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    loss = loss_fn(module, inputs) if loss_fn else _default_loss(module(*inputs))
                del loss
    return counter.report().activation_bytes
