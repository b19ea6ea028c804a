"""Training FLOPs: the analytic transformer formula for :class:`GPTConfig`, and ``torch.utils.flop_counter`` for any
module.

Convention (PaLM appendix B, Megatron-LM): only matrix multiplications count, a multiply-add is 2 FLOPs, the backward
pass costs twice the forward, and attention scores/values count the full ``T x T`` product even under a causal mask
(as ``torch.utils.flop_counter`` does). Norms, softmax and element-wise ops are not counted (< 1% here).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_trainopt.models.config import GPTConfig

__all__ = ["TransformerFlops", "count_flops", "meta_copy", "transformer_flops"]


@dataclass(frozen=True)
class TransformerFlops:
    """FLOPs of one batch of ``batch_size`` sequences of ``seq_len`` tokens.

    Args:
        forward: model FLOPs of the forward pass.
        block_forward: the part of ``forward`` spent in the transformer blocks (what checkpointing recomputes).
        attention_forward: the ``QK^T`` and ``AV`` part of ``forward``.
    """

    forward: int
    block_forward: int
    attention_forward: int

    @property
    def train(self) -> int:
        """Model FLOPs of forward + backward (3x forward): the numerator of MFU."""
        return 3 * self.forward

    def hardware_train(self, recompute_fraction: float = 0.0) -> int:
        """FLOPs the hardware executes when ``recompute_fraction`` of the blocks' forward is recomputed (HFU)."""
        return self.train + int(round(recompute_fraction * self.block_forward))


def transformer_flops(cfg: GPTConfig, seq_len: int, batch_size: int = 1) -> TransformerFlops:
    """Analytic FLOPs of :class:`~lightning_trainopt.models.GPT` for a ``(batch_size, seq_len)`` batch."""
    d, hd = cfg.d_model, cfg.head_dim
    matmul_per_block = d * cfg.n_heads * hd + 2 * d * cfg.kv_heads * hd + cfg.n_heads * hd * d + 3 * d * cfg.ffn_hidden
    tokens = batch_size * seq_len
    # QK^T and AV: 2 * (2 * T * T * head_dim) per head.
    attention = 4 * batch_size * cfg.n_heads * seq_len * seq_len * hd
    block = cfg.n_layers * (2 * matmul_per_block * tokens + attention)
    head = 2 * d * cfg.vocab_size * tokens
    return TransformerFlops(forward=block + head, block_forward=block, attention_forward=cfg.n_layers * attention)


def meta_copy(module: nn.Module, share: tuple[Any, ...] = ()) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory is allocated).

    Objects in ``share`` (e.g. a LightningModule's Trainer) are referenced by the copy, not copied.
    """
    memo: dict[int, Any] = {id(obj): obj for obj in share}
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _to_meta(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj, device="meta")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_meta(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_meta(v) for k, v in obj.items()}
    return obj


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    if logits is None and isinstance(out, (tuple, list)):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cannot find a tensor to backpropagate in the model output of type {type(out).__name__}")
    return logits.float().sum()


def count_flops(
    module: nn.Module,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: bool = True,
    share: tuple[Any, ...] = (),
) -> int:
    """FLOPs of ``module(example_input)`` (and its backward) counted by ``torch.utils.flop_counter`` on a meta copy.

    Args:
        module: any module; it is copied to the meta device, so this costs no memory or compute.
        example_input: a tensor, a tuple/list of positional arguments, or a dict of keyword arguments.
        loss_fn: maps the output to a scalar to backpropagate; default: sum of the (first) output tensor.
        backward: also count the backward pass.
        share: objects the meta copy references instead of copying (see :func:`meta_copy`).
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = meta_copy(module, share)
    inputs = _to_meta(example_input)
    counter = FlopCounterMode(display=False)
    with counter:
        if isinstance(inputs, dict):
            out = model(**inputs)
        elif isinstance(inputs, (tuple, list)):
            out = model(*inputs)
        else:
            out = model(inputs)
        if backward:
            (loss_fn or _default_loss)(out).backward()
    return int(counter.get_total_flops())
