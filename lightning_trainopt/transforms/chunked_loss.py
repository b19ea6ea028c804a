"""The output head and cross-entropy computed chunk by chunk over the tokens, so the full logits never exist.

A language model's last step turns ``N`` hidden states into ``N x V`` logits and their cross-entropy. Autograd keeps
the logits (and their fp32 copy) for backward: ``4·V`` bytes per token in fp32 alone, 0.5 MiB per token at a 128k
vocabulary, often the largest single activation of the step. :func:`chunked_cross_entropy` computes the loss
``chunk_size`` tokens at a time and keeps only the hidden states and one log-sum-exp per token; backward recomputes
each chunk's logits and turns them into the gradients of the hidden states and of the weight right away.

The weight must be gathered when this runs under ZeRO-3 or FSDP2 (sharded parameters are empty placeholders outside
their module's forward). :class:`ChunkedLMHeadLoss` therefore runs inside the head module's own call, so the
strategy's hooks gather the weight for forward and again for backward, exactly as for the plain ``lm_head(x)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_trainopt.exceptions import ConfigError

__all__ = [
    "ChunkedLMHeadLoss",
    "chunked_cross_entropy",
    "forward_replaced",
    "head_returns_loss",
    "head_weight",
    "logits_dtype",
    "run_in_head_call",
    "vocab_parallel_chunked_cross_entropy",
]

#: Tokens per chunk: 1024 tokens x 128k vocabulary = 0.5 GiB of fp32 logits at a time.
DEFAULT_CHUNK_TOKENS = 1024


def logits_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, w)`` gives: autocast's when autocast is on for ``x``'s device, else ``x``'s own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
    ) -> torch.Tensor:
        # The logits' dtype: autocast's under mixed precision (as F.linear would give), else the hidden states'. The
        # ops below run with autocast off in that dtype, so backward (which runs outside autocast) recomputes them
        # exactly.
        device = hidden.device.type
        dtype = logits_dtype(hidden)
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                logits = F.linear(hidden[start:end].to(dtype), w, b).float()
                lse[start:end] = torch.logsumexp(logits, dim=-1)
                t = targets[start:end]
                picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                total += ((lse[start:end] - picked) * valid[start:end]).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, lse, count)
        ctx.chunk, ctx.ignore_index, ctx.dtype = chunk, ignore_index, dtype
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse, count = ctx.saved_tensors
        scale = grad_out.float() / count
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        )
        dtype = ctx.dtype
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            t = targets[start:end]
            ok = (t != ctx.ignore_index).unsqueeze(1)
            # d(lse - logit[t]) / d logits = softmax - onehot(t), for the tokens that count.
            probs = torch.exp(F.linear(h, w, b).float() - lse[start:end].unsqueeze(1))
            probs.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -torch.ones_like(probs[:, :1]))
            grad_logits = (probs * ok * scale).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
        )


class _VocabParallelChunkedCrossEntropy(torch.autograd.Function):
    """:class:`_ChunkedCrossEntropy` over a head weight sharded on the vocabulary across ``group`` (tensor
    parallelism): each rank computes its ``V / tp`` logits of a chunk; the max, the sum of exponentials and the target's
    logit are all-reduced over the group, so every rank gets the whole vocabulary's log-sum-exp and the same loss.
    Backward sums the hidden states' gradient over the group (each rank's shard contributes ``grad_logits @ w``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
        vocab_start: int,
        group: Any,
    ) -> torch.Tensor:
        import torch.distributed as dist

        device = hidden.device.type
        dtype = logits_dtype(hidden)
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1)
        rows = weight.shape[0]
        local = targets - vocab_start
        mine = (local >= 0) & (local < rows)  # the target's logit is on this rank's shard
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device, enabled=False):
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                logits = F.linear(hidden[start:end].to(dtype), w).float()
                peak = logits.amax(dim=-1)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
                picked = logits.gather(1, local[start:end].clamp(0, rows - 1).unsqueeze(1)).squeeze(1)
                # One all-reduce for both sums: the shards' sums of exponentials and the one shard's target logit.
                sums = torch.stack([torch.exp(logits - peak.unsqueeze(1)).sum(-1), picked * mine[start:end]])
                dist.all_reduce(sums, group=group)
                lse[start:end] = peak + sums[0].log()
                total += ((lse[start:end] - sums[1]) * valid[start:end]).sum()
        ctx.save_for_backward(hidden, weight, local, mine, valid, lse, count)
        ctx.chunk, ctx.dtype, ctx.group = chunk, dtype, group
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        import torch.distributed as dist

        hidden, weight, local, mine, valid, lse, count = ctx.saved_tensors
        scale = grad_out.float() / count
        rows, dtype = weight.shape[0], ctx.dtype
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            probs = torch.exp(F.linear(h, w).float() - lse[start:end].unsqueeze(1))
            hit = -mine[start:end].to(probs.dtype).unsqueeze(1)  # onehot(t) only where t is on this shard
            probs.scatter_add_(1, local[start:end].clamp(0, rows - 1).unsqueeze(1), hit)
            grad_logits = (probs * valid[start:end].unsqueeze(1) * scale).to(dtype)
            grad_hidden[start:end] = (grad_logits @ w).float()
            grad_weight += (grad_logits.t() @ h).float()
        dist.all_reduce(grad_hidden, group=ctx.group)  # every shard's part of d loss / d hidden
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None, None


def vocab_parallel_chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> torch.Tensor:
    """:func:`chunked_cross_entropy` with ``weight`` a DTensor sharded over the vocabulary (tensor parallelism).

    The loss-parallel head's counterpart: no rank holds more than one chunk of ``V / tp`` logits. ``hidden`` is a
    DTensor replicated over the group (what ColwiseParallel's input hook gives the head) or a plain tensor that is
    the same on every rank of the group; the loss is a plain scalar, the same on every rank of the group.

    Args:
        hidden: ``(..., d)`` hidden states.
        weight: ``(V, d)`` DTensor, ``Shard(0)`` on one mesh dimension and replicated on any other.
        targets: ``(...)`` token ids, the same on every rank of the group.
        chunk_tokens: tokens per chunk.
        ignore_index: the target id that does not count.

    Raises:
        ValueError: ``weight`` is not sharded on the vocabulary over exactly one mesh dimension.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = list(weight.placements)  # type: ignore[attr-defined]
    sharded = [i for i, p in enumerate(placements) if p == Shard(0)]
    if len(sharded) != 1 or any(p != Replicate() for i, p in enumerate(placements) if i != sharded[0]):
        raise ValueError(f"the head weight's placements {placements} are not Shard(0) over one mesh dimension")
    mesh, dim = weight.device_mesh, sharded[0]  # type: ignore[attr-defined]
    local_weight = weight.to_local()  # type: ignore[attr-defined]
    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    if weight.shape[0] % mesh.size(dim):
        raise ValueError(f"a vocabulary of {weight.shape[0]} does not split evenly over {mesh.size(dim)} ranks")
    vocab_start = mesh.get_local_rank(dim) * local_weight.shape[0]
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _VocabParallelChunkedCrossEntropy.apply(  # type: ignore[no-any-return]
        flat, local_weight, targets.reshape(-1), chunk_tokens, ignore_index, vocab_start, mesh.get_group(dim)
    )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, never holding all the logits.

    Equal to ``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=ignore_index)``: the
    logits are computed in ``hidden``'s dtype and reduced in fp32, chunk by chunk; backward recomputes them.

    Args:
        hidden: ``(..., d)`` hidden states (flattened to tokens).
        weight: ``(V, d)`` output head weight.
        targets: ``(...)`` token ids; ``ignore_index`` entries do not count.
        bias: ``(V,)`` head bias, if the head has one.
        chunk_tokens: tokens per chunk.
        ignore_index: the target id that does not count (padding).

    Raises:
        ConfigError: ``chunk_tokens`` is not a positive integer.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError("loss.chunk_tokens", chunk_tokens, "use a positive number of tokens per chunk, e.g. 1024.")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedCrossEntropy.apply(  # type: ignore[no-any-return]
        flat, weight, bias, targets.reshape(-1), chunk_tokens, ignore_index
    )


def head_weight(head: nn.Module, loss_name: str) -> torch.Tensor:
    """The output head's weight matrix, or a ConfigError naming ``loss`` when the head has none."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ConfigError(
            "loss",
            loss_name,
            f"the output head {type(head).__name__} has no weight matrix; use loss=standard for this model.",
        )
    return weight


@contextmanager
def forward_replaced(head: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """While inside, ``head(...)`` runs ``forward`` (set on the instance), so the strategy's module hooks still fire
    around it; the instance's own ``forward`` (if it had one) is put back on leaving."""
    own = head.__dict__.get("forward")
    head.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own  # type: ignore[method-assign]


def run_in_head_call(head: nn.Module, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *args: Any) -> Any:
    """``fn(*args)`` run as ``head``'s forward, through ``head(*args)``, so the strategy's module hooks fire.

    Under ZeRO-3 and FSDP2 the head's weight is a shard outside its forward: calling the module gathers it for
    forward and registers the re-gather for backward. The head's ``forward`` is swapped for this call only.
    """
    with forward_replaced(head, fn):
        return head(*args)


@contextmanager
def head_returns_loss(head: nn.Module, loss: Any, targets: torch.Tensor, shift: bool = False) -> Iterator[None]:
    """While inside, calling ``head(hidden)`` returns ``loss.compute(head, hidden, targets)`` instead of logits.

    The model's own forward then computes the loss where it would compute the logits: inside the head's call (ZeRO-3
    gathers its weight) and inside the forward of the FSDP2 unit that holds it (its root unit is unsharded there; a
    loss computed after the model's forward would meet the head's weight sharded again). The forward's "logits" are
    the scalar loss.

    Args:
        head: the output head module.
        loss: a head loss with ``compute(head, hidden, targets)`` (:class:`ChunkedLMHeadLoss`, ``LigerLMHeadLoss``).
        targets: the target ids of the positions the head sees.
        shift: drop the head input's last position first (Hugging Face batches: position t predicts label t + 1).
    """

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return loss.compute(head, hidden[:, :-1] if shift else hidden, targets)  # type: ignore[no-any-return]

    with forward_replaced(head, forward):
        yield


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ChunkedLMHeadLoss:
    """Run :func:`chunked_cross_entropy` through an output head module's own call (``loss(head, hidden, targets)``).

    Args:
        chunk_tokens: tokens per chunk.
        ignore_index: the target id that does not count.

    Example::

        loss = ChunkedLMHeadLoss()(model.lm_head, hidden_states, targets)
    """

    name = "chunked_ce"

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = -100) -> None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(
                "loss.chunk_tokens", chunk_tokens, "use a positive number of tokens per chunk, e.g. 1024."
            )
        self.chunk_tokens = chunk_tokens
        self.ignore_index = ignore_index

    def compute(self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss from the head's parameters as they are (call it where they are gathered: inside the head's call)."""
        bias = getattr(head, "bias", None)
        weight = head_weight(head, self.name)
        if _is_dtensor(weight):  # tensor parallelism: the head is sharded over the vocabulary
            if bias is not None:
                raise ConfigError(
                    "loss",
                    self.name,
                    "a head with a bias is not supported under tensor parallelism; use loss=standard.",
                )
            return vocab_parallel_chunked_cross_entropy(hidden, weight, targets, self.chunk_tokens, self.ignore_index)
        return chunked_cross_entropy(hidden, weight, targets, bias, self.chunk_tokens, self.ignore_index)

    def __call__(self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head_weight(head, self.name)
        return run_in_head_call(head, lambda h, t: self.compute(head, h, t), hidden, targets)  # type: ignore[no-any-return]
