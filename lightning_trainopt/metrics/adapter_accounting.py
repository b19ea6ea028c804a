"""Bytes of a model trained through adapters, read from the model: the frozen base (4-bit codes and their scales
apart), the trainable adapters, their gradients and their optimizer states.

A parameter is frozen when it does not require a gradient. A 4-bit base weight is a parameter carrying a
``quant_state`` (bitsandbytes' ``Params4bit``): its own storage holds the packed codes; the state holds the absmax
(and, under double quantization, their fp32 scales, offset and code map) and the weight's code table, each counted
once however many weights share it (double quantization's dynamic map is one tensor for all). Each storage is counted
once; sharded (DTensor) parameters by their local shard.

Example::

    adapter_breakdown(peft_model, [optimizer])["adapter_optimizer_states"]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lightning_trainopt.metrics.memory_accounting import tensor_leaves

__all__ = ["ADAPTER_ROWS", "adapter_breakdown", "has_frozen_params", "param_count"]

#: The rows :func:`adapter_breakdown` returns, in the order reports print them.
ADAPTER_ROWS = (
    "frozen_base",
    "frozen_base_4bit",
    "frozen_base_4bit_scales",
    "adapter_params",
    "adapter_grads",
    "adapter_optimizer_states",
)


def has_frozen_params(module: torch.nn.Module) -> bool:
    """Whether some parameter of ``module`` is frozen (an adapter's base, a teacher): the rows apply."""
    return any(not p.requires_grad for p in module.parameters())


def param_count(param: torch.Tensor) -> int:
    """The number of weights ``param`` stands for, whole: ZeRO-3's ``ds_numel`` for a partitioned placeholder, the
    original shape's for a 4-bit weight (its storage packs several weights an element: 4 into a bf16, 2 into a
    uint8), else ``numel()`` (an FSDP2 ``DTensor``'s is already the whole tensor's)."""
    ds_numel = getattr(param, "ds_numel", None)
    if ds_numel is not None:
        return int(ds_numel)
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    if shape is not None:
        return int(torch.Size(shape).numel())
    return int(param.numel())


def _quant_state_tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors of a bitsandbytes ``QuantState`` (public fields), the nested state's included."""
    for name in ("absmax", "code", "offset"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(nested)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class _Bytes:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def of(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            for t in tensor_leaves(_local(tensor)):
                if t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                if storage.nbytes() and key not in self.seen:
                    self.seen.add(key)
                    total += storage.nbytes()
        return total


def _state_tensors(optimizers: Iterable[Any], params: set[int]) -> Iterator[torch.Tensor]:
    for opt in optimizers:
        state = getattr(opt, "state", {})
        for p, s in state.items() if isinstance(state, dict) else ():
            if id(p) not in params or not isinstance(s, dict):
                continue
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    yield v


def adapter_breakdown(module: torch.nn.Module, optimizers: Iterable[Any] = ()) -> dict[str, int]:
    """Per-rank bytes of :data:`ADAPTER_ROWS`.

    Args:
        module: the model (a peft model, or any module with frozen parameters).
        optimizers: torch optimizers stepping the trainable parameters (their ``state`` per parameter).
    """
    count = _Bytes()
    params = list(module.parameters())
    frozen = [p for p in params if not p.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    quantized = [p for p in frozen if getattr(p, "quant_state", None) is not None]
    q_ids = {id(p) for p in quantized}
    states = [getattr(p, "quant_state") for p in quantized]  # Params4bit's attribute
    return {
        "frozen_base": count.of(p.detach() for p in frozen if id(p) not in q_ids),
        "frozen_base_4bit": count.of(p.detach() for p in quantized),
        "frozen_base_4bit_scales": count.of(t for s in states for t in _quant_state_tensors(s)),
        "adapter_params": count.of(p.detach() for p in trainable),
        "adapter_grads": count.of(p.grad for p in trainable),
        "adapter_optimizer_states": count.of(_state_tensors(optimizers, {id(p) for p in trainable})),
    }
