"""Knowledge-distillation loss computed chunk by chunk over the tokens: neither model's full logits ever exist.

``loss = (1 - alpha) * CE(student, targets) + alpha * T^2 * KL``, with ``KL = KL(p_teacher^T || p_student^T)``
(``kind="forward"``, Hinton et al.) or ``KL(p_student^T || p_teacher^T)`` (``kind="reverse"``), ``p^T = softmax(z /
T)``; both terms are means over the tokens whose target is not ``ignore_index``. The ``T^2`` keeps the soft term's
gradient on the scale of the hard term's as ``T`` grows.

Both models' logits are ``N x V`` (fp32 for the softmax: ``8·V`` bytes per token for the two of them, 1 MiB per token
at a 128k vocabulary). :func:`chunked_distillation_loss` takes the two models' *hidden states* and head weights and
projects ``chunk_tokens`` tokens at a time through both heads. The gradient of the loss with respect to the student's
logits is known in closed form, so each chunk's contribution to the gradients of the student's hidden states and head
weight is computed right away in forward (as Liger-Kernel's fused linear cross-entropy does) and backward only scales
them: nothing but the two hidden-state tensors and those gradients is kept, and the teacher's head weight is not needed
again in backward (under ZeRO-3/FSDP2 it is resharded as soon as the teacher's forward ends).

:class:`DistillHeadLoss` is the student's head loss (``head_returns_loss``): it runs inside the student head's own call,
so the strategy gathers the student's head weight exactly as for the plain ``lm_head(x)``. Under tensor parallelism
the head weight is a DTensor sharded over the vocabulary and :func:`vocab_parallel_chunked_distillation_loss` runs
instead: each rank projects only its ``V / tp`` rows of both heads, and the softmaxes, the cross-entropy and the KL are
reduced over the tensor-parallel group (as ``chunked_loss.vocab_parallel_chunked_cross_entropy`` does for ``loss=
chunked_ce``): no rank ever holds a token's whole-vocabulary logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.chunked_loss import DEFAULT_CHUNK_TOKENS, head_weight, logits_dtype, run_in_head_call

__all__ = [
    "DistillHeadLoss",
    "DistillTerms",
    "TeacherOutputs",
    "check_distill_args",
    "chunked_distillation_loss",
    "distillation_loss",
    "vocab_parallel_chunked_distillation_loss",
]

DistillKind = Literal["forward", "reverse"]
_KINDS = ("forward", "reverse")


def check_distill_args(alpha: Any, temperature: Any, kind: Any, chunk_tokens: Any = DEFAULT_CHUNK_TOKENS) -> None:
    """Refuse a distillation setting that cannot be meant, naming its ``distill.*`` key.

    Raises:
        ConfigError: ``alpha`` outside [0, 1], ``temperature`` not positive, an unknown ``kind``, or ``chunk_tokens``
            not a positive integer.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ConfigError("distill.alpha", alpha, "use a weight in [0, 1] of the KL term (0: plain cross-entropy).")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not float(temperature) > 0.0:
        raise ConfigError("distill.temperature", temperature, "use a positive softmax temperature, e.g. 2.0.")
    if kind not in _KINDS:
        raise ConfigError(
            "distill.kind", kind, "use forward (KL(teacher || student)) or reverse (KL(student || teacher))."
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError("distill.chunk_tokens", chunk_tokens, "use a positive number of tokens per chunk, e.g. 1024.")


@dataclass(frozen=True)
class DistillTerms:
    """The loss of one batch and its two terms (means over the counted tokens, detached).

    Args:
        loss: ``(1 - alpha) * ce + alpha * T^2 * kl`` (differentiable).
        ce: the student's cross-entropy against the targets.
        kl: the KL divergence at temperature ``T`` (without the ``T^2`` factor).
        logits_width: the last dimension of the widest logits chunk this rank computed: ``V``, or ``V / tp`` under
            tensor parallelism (the vocabulary-parallel loss); 0 for the whole-logits reference.
    """

    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    logits_width: int = 0


def _kl_and_grad(
    zs: torch.Tensor, zt: torch.Tensor, temperature: float, kind: str, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token KL at ``temperature`` of fp32 logits, and its gradient with respect to the student's logits."""
    log_s = F.log_softmax(zs / temperature, dim=-1)
    log_t = F.log_softmax(zt / temperature, dim=-1)
    if kind == "forward":
        p_t = log_t.exp()
        kl = (p_t * (log_t - log_s)).sum(-1)
        # d KL(p_t || p_s) / d z_s = (p_s - p_t) / T
        grad = (log_s.exp() - p_t) / temperature if want_grad else None
    else:
        p_s = log_s.exp()
        diff = log_s - log_t
        kl = (p_s * diff).sum(-1)
        # d KL(p_s || p_t) / d z_s = p_s * (log p_s - log p_t - KL) / T
        grad = p_s * (diff - kl.unsqueeze(1)) / temperature if want_grad else None
    return kl, grad


class _ChunkedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        t_hidden: torch.Tensor,
        t_weight: torch.Tensor,
        t_bias: torch.Tensor | None,
        targets: torch.Tensor,
        alpha: float,
        temperature: float,
        kind: str,
        chunk: int,
        ignore_index: int,
        want_grad: bool,
        probe: dict[str, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The logits' dtype: autocast's under mixed precision (as F.linear would give), else the hidden states'; the
        # softmaxes and sums run in fp32 (as chunked_cross_entropy does).
        device = hidden.device.type
        dtype, t_dtype = logits_dtype(hidden), logits_dtype(t_hidden)
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1).float()
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kl_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_h, need_w = want_grad and ctx.needs_input_grad[0], want_grad and ctx.needs_input_grad[1]
        need_b = want_grad and bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        any_grad = need_h or need_w or need_b
        with torch.autocast(device, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            tw, tb = t_weight.to(t_dtype), None if t_bias is None else t_bias.to(t_dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                h = hidden[start:end].to(dtype)
                zs = F.linear(h, w, b).float()
                zt = F.linear(t_hidden[start:end].to(t_dtype), tw, tb).float()
                probe["logits_width"] = max(probe.get("logits_width", 0), zs.shape[-1], zt.shape[-1])
                ok = valid[start:end]
                t = targets[start:end].clamp(min=0)
                lse = torch.logsumexp(zs, dim=-1)
                ce_sum += ((lse - zs.gather(1, t.unsqueeze(1)).squeeze(1)) * ok).sum()
                kl, g_kl = _kl_and_grad(zs, zt, temperature, kind, any_grad)
                kl_sum += (kl * ok).sum()
                if not any_grad:
                    continue
                assert g_kl is not None
                # d CE / d z_s = softmax(z_s) - onehot(t)
                g_ce = torch.exp(zs - lse.unsqueeze(1))
                g_ce.scatter_add_(1, t.unsqueeze(1), -torch.ones_like(g_ce[:, :1]))
                g = ((1.0 - alpha) * g_ce + (alpha * temperature * temperature) * g_kl) * (ok.unsqueeze(1) / count)
                g = g.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (g @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (g.t() @ h).float()
                if grad_bias is not None:
                    grad_bias += g.float().sum(0)
        ce, kl_mean = ce_sum / count, kl_sum / count
        loss = (1.0 - alpha) * ce + alpha * temperature * temperature * kl_mean
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
        )
        ctx.mark_non_differentiable(ce, kl_mean)
        return loss, ce, kl_mean

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        if grad_hidden is None and grad_weight is None and grad_bias is None and any(ctx.needs_input_grad[:3]):
            raise RuntimeError(
                "chunked_distillation_loss was computed without gradients (want_grad=False); compute it with "
                "want_grad=True (the default under torch.enable_grad) to backpropagate through it."
            )
        scale = grad_out.float()

        def scaled(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else (g.float() * scale).to(g.dtype)

        return (scaled(grad_hidden), scaled(grad_weight), scaled(grad_bias), *([None] * 11))


def chunked_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    alpha: float = 0.5,
    temperature: float = 1.0,
    kind: DistillKind = "forward",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> DistillTerms:
    """The distillation loss of the student's and the teacher's hidden states, ``chunk_tokens`` tokens at a time.

    Equal (values and gradients) to :func:`distillation_loss` of ``F.linear(hidden, weight, bias)`` and
    ``F.linear(teacher_hidden, teacher_weight, teacher_bias)``. The teacher's tensors get no gradient.

    Args:
        hidden: ``(..., d)`` the student's hidden states before its head.
        weight: ``(V, d)`` the student's head weight.
        teacher_hidden: ``(..., d_t)`` the teacher's hidden states, one per student position.
        teacher_weight: ``(V, d_t)`` the teacher's head weight (the same vocabulary).
        targets: ``(...)`` token ids; ``ignore_index`` positions count in neither term.
        bias: the student head's bias, if any.
        teacher_bias: the teacher head's bias, if any.
        alpha: weight of the KL term.
        temperature: softmax temperature of the KL term.
        kind: ``forward`` KL(teacher || student) or ``reverse`` KL(student || teacher).
        chunk_tokens: tokens per chunk.
        ignore_index: the target id that does not count.

    Raises:
        ConfigError: a bad ``alpha``, ``temperature``, ``kind`` or ``chunk_tokens``.
        ValueError: the two heads' vocabularies or the two models' token counts differ.
    """
    check_distill_args(alpha, temperature, kind, chunk_tokens)
    flat = hidden.reshape(-1, hidden.shape[-1])
    t_flat = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student vocabulary {weight.shape[0]} != teacher vocabulary {teacher_weight.shape[0]}")
    if flat.shape[0] != t_flat.shape[0]:
        raise ValueError(f"student has {flat.shape[0]} positions, teacher {t_flat.shape[0]}")
    want_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    probe: dict[str, int] = {}
    loss, ce, kl = _ChunkedDistillation.apply(
        flat,
        weight,
        bias,
        t_flat.detach(),
        teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
        targets.reshape(-1),
        float(alpha),
        float(temperature),
        kind,
        chunk_tokens,
        ignore_index,
        want_grad,
        probe,
    )
    return DistillTerms(loss, ce, kl, probe.get("logits_width", 0))


class _VocabParallelChunkedDistillation(torch.autograd.Function):
    """:class:`_ChunkedDistillation` over head weights sharded on the vocabulary across ``group`` (tensor parallelism):
    each rank projects a chunk of tokens through its ``V / tp`` rows of both heads. Per chunk, three all-reduces over
    the group make every softmax whole: the max of each model's logits (one op, the two stacked), then the sums of
    exponentials (the student's at 1 and at ``T``, the teacher's at ``T``) with the target's logit, then the per-token
    KL (the reverse KL's gradient needs it). The gradients are computed in forward as in the one-device loss: each
    rank its shard of the head weight's, and its part of the hidden states', summed over the group once at the end.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        t_hidden: torch.Tensor,
        t_weight: torch.Tensor,
        targets: torch.Tensor,
        alpha: float,
        temperature: float,
        kind: str,
        chunk: int,
        ignore_index: int,
        vocab_start: int,
        group: Any,
        want_grad: bool,
        probe: dict[str, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        device = hidden.device.type
        dtype, t_dtype = logits_dtype(hidden), logits_dtype(t_hidden)
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1).float()
        rows, T = weight.shape[0], temperature
        local = targets - vocab_start
        mine = (local >= 0) & (local < rows)  # the target's logit is on this rank's shard
        at = local.clamp(0, rows - 1).unsqueeze(1)
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kl_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_h, need_w = want_grad and ctx.needs_input_grad[0], want_grad and ctx.needs_input_grad[1]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        with torch.autocast(device, enabled=False):
            w, tw = weight.to(dtype), t_weight.to(t_dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                h = hidden[start:end].to(dtype)
                zs = F.linear(h, w).float()  # (chunk, V / tp): this rank's slice of the vocabulary
                zt = F.linear(t_hidden[start:end].to(t_dtype), tw).float()
                probe["logits_width"] = max(probe.get("logits_width", 0), zs.shape[-1], zt.shape[-1])
                peaks = torch.stack([zs.amax(dim=-1), zt.amax(dim=-1)])
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
                a_s, a_t = zs - peaks[0].unsqueeze(1), zt - peaks[1].unsqueeze(1)
                ok, hit = valid[start:end], mine[start:end]
                picked = zs.gather(1, at[start:end]).squeeze(1) * hit
                # max(z / T) = max(z) / T for T > 0: the one max serves the softmax at 1 and at T.
                sums = torch.stack([a_s.exp().sum(-1), (a_s / T).exp().sum(-1), (a_t / T).exp().sum(-1), picked])
                dist.all_reduce(sums, group=group)
                lse = peaks[0] + sums[0].log()
                ce_sum += ((lse - sums[3]) * ok).sum()
                log_s = a_s / T - sums[1].log().unsqueeze(1)
                log_t = a_t / T - sums[2].log().unsqueeze(1)
                if kind == "forward":
                    p = log_t.exp()
                    kl = (p * (log_t - log_s)).sum(-1)
                else:
                    p = log_s.exp()
                    kl = (p * (log_s - log_t)).sum(-1)
                dist.all_reduce(kl, group=group)  # each rank summed its slice of the vocabulary
                kl_sum += (kl * ok).sum()
                if not (need_h or need_w):
                    continue
                # The one-device gradients (see _kl_and_grad), on this rank's slice of the logits.
                g_kl = (log_s.exp() - p) / T if kind == "forward" else p * (log_s - log_t - kl.unsqueeze(1)) / T
                g_ce = torch.exp(zs - lse.unsqueeze(1))
                g_ce.scatter_add_(1, at[start:end], -hit.to(g_ce.dtype).unsqueeze(1))
                g = ((1.0 - alpha) * g_ce + (alpha * T * T) * g_kl) * (ok.unsqueeze(1) / count)
                g = g.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (g @ w).float()
                if grad_weight is not None:
                    grad_weight += (g.t() @ h).float()
        if grad_hidden is not None:
            dist.all_reduce(grad_hidden, group=group)  # every shard's part of d loss / d hidden
        ce, kl_mean = ce_sum / count, kl_sum / count
        loss = (1.0 - alpha) * ce + alpha * T * T * kl_mean
        ctx.save_for_backward(
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
        )
        ctx.mark_non_differentiable(ce, kl_mean)
        return loss, ce, kl_mean

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is None and grad_weight is None and any(ctx.needs_input_grad[:2]):
            raise RuntimeError(
                "vocab_parallel_chunked_distillation_loss was computed without gradients (want_grad=False); compute "
                "it under torch.enable_grad to backpropagate through it."
            )
        scale = grad_out.float()

        def scaled(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else (g.float() * scale).to(g.dtype)

        return (scaled(grad_hidden), scaled(grad_weight), *([None] * 12))


def _vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
    """A head weight DTensor sharded on the vocabulary: its local rows, the first row's vocabulary id, the group."""
    from torch.distributed.tensor import Replicate, Shard

    placements = list(weight.placements)  # type: ignore[attr-defined]
    sharded = [i for i, p in enumerate(placements) if p == Shard(0)]
    if len(sharded) != 1 or any(p != Replicate() for i, p in enumerate(placements) if i != sharded[0]):
        raise ValueError(f"the head weight's placements {placements} are not Shard(0) over one mesh dimension")
    mesh, dim = weight.device_mesh, sharded[0]  # type: ignore[attr-defined]
    if weight.shape[0] % mesh.size(dim):
        raise ValueError(f"a vocabulary of {weight.shape[0]} does not split evenly over {mesh.size(dim)} ranks")
    local_weight = weight.to_local()  # type: ignore[attr-defined]
    return local_weight, mesh.get_local_rank(dim) * local_weight.shape[0], mesh.get_group(dim)


def vocab_parallel_chunked_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    alpha: float = 0.5,
    temperature: float = 1.0,
    kind: DistillKind = "forward",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> DistillTerms:
    """:func:`chunked_distillation_loss` with the student's head weight a DTensor sharded over the vocabulary.

    No rank computes more than ``V / tp`` logits of a token (``DistillTerms.logits_width``): each projects a chunk
    through its rows of both heads and the softmaxes, the cross-entropy and the KL are reduced over the tensor-parallel
    group. The loss is a plain scalar, the same on every rank of the group; backward gives each rank its shard of the
    head weight's gradient and the whole gradient of the (replicated) hidden states.

    Args:
        hidden: ``(..., d)`` the student's hidden states: a DTensor replicated over the group (what ColwiseParallel's
            input hook gives the head) or a plain tensor, the same on every rank of the group.
        weight: ``(V, d)`` DTensor, ``Shard(0)`` on one mesh dimension and replicated on any other.
        teacher_hidden: ``(..., d_t)`` the teacher's hidden states (a replicated DTensor or a plain tensor).
        teacher_weight: ``(V, d_t)`` sharded as ``weight`` (a tensor-parallel teacher) or a plain whole tensor, of
            which this rank uses the rows of its vocabulary slice (a view, no copy).
        targets: ``(...)`` token ids, the same on every rank of the group.
        alpha: weight of the KL term.
        temperature: softmax temperature of the KL term.
        kind: ``forward`` or ``reverse``.
        chunk_tokens: tokens per chunk.
        ignore_index: the target id that does not count.

    Raises:
        ConfigError: a bad ``alpha``, ``temperature``, ``kind`` or ``chunk_tokens``.
        ValueError: a weight not sharded on the vocabulary over one mesh dimension, the two heads sharded
            differently, or the two vocabularies or token counts differ.
    """
    from torch.distributed.tensor import DTensor

    check_distill_args(alpha, temperature, kind, chunk_tokens)
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student vocabulary {weight.shape[0]} != teacher vocabulary {teacher_weight.shape[0]}")
    local_weight, vocab_start, group = _vocab_shard(weight)
    rows = local_weight.shape[0]
    if isinstance(teacher_weight, DTensor):
        t_local, t_start, _ = _vocab_shard(teacher_weight)
        if (t_start, t_local.shape[0]) != (vocab_start, rows):
            raise ValueError(
                f"the teacher's head holds vocabulary rows {t_start}..{t_start + t_local.shape[0]} on this rank, "
                f"the student's {vocab_start}..{vocab_start + rows}"
            )
    else:
        t_local = teacher_weight[vocab_start : vocab_start + rows]
    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()  # replicated: no communication; its gradient is the whole one on each rank
    if isinstance(teacher_hidden, DTensor):
        teacher_hidden = teacher_hidden.full_tensor()
    flat = hidden.reshape(-1, hidden.shape[-1])
    t_flat = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    if flat.shape[0] != t_flat.shape[0]:
        raise ValueError(f"student has {flat.shape[0]} positions, teacher {t_flat.shape[0]}")
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or local_weight.requires_grad)
    probe: dict[str, int] = {}
    loss, ce, kl = _VocabParallelChunkedDistillation.apply(
        flat,
        local_weight,
        t_flat.detach(),
        t_local.detach(),
        targets.reshape(-1),
        float(alpha),
        float(temperature),
        kind,
        chunk_tokens,
        ignore_index,
        vocab_start,
        group,
        want_grad,
        probe,
    )
    return DistillTerms(loss, ce, kl, probe.get("logits_width", 0))


def distillation_loss(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    alpha: float = 0.5,
    temperature: float = 1.0,
    kind: DistillKind = "forward",
    ignore_index: int = -100,
) -> DistillTerms:
    """The same loss from whole logits (every token's ``V`` logits of both models at once): the reference.

    Args:
        logits: ``(..., V)`` the student's logits.
        teacher_logits: ``(..., V)`` the teacher's logits (no gradient flows into them).
        targets: ``(...)`` token ids.
        alpha: weight of the KL term.
        temperature: softmax temperature of the KL term.
        kind: ``forward`` or ``reverse``.
        ignore_index: the target id that does not count.
    """
    check_distill_args(alpha, temperature, kind)
    zs = logits.reshape(-1, logits.shape[-1]).float()
    zt = teacher_logits.reshape(-1, teacher_logits.shape[-1]).detach().float()
    y = targets.reshape(-1)
    ok = (y != ignore_index).float()
    count = ok.sum().clamp(min=1)
    ce = F.cross_entropy(zs, y, ignore_index=ignore_index, reduction="sum") / count
    log_s, log_t = F.log_softmax(zs / temperature, -1), F.log_softmax(zt / temperature, -1)
    if kind == "forward":
        kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
    else:
        kl = F.kl_div(log_t, log_s, log_target=True, reduction="none").sum(-1)
    kl = (kl * ok).sum() / count
    loss = (1.0 - alpha) * ce + alpha * temperature * temperature * kl
    return DistillTerms(loss, ce.detach(), kl.detach())


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel teacher's head beside a student that is not tensor-parallel: gathered."""
    return t.full_tensor() if _is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]


@dataclass(frozen=True)
class TeacherOutputs:
    """What the teacher's forward left for the student's head loss: its hidden states and its head weight.

    Args:
        hidden: ``(batch, seq, d_t)`` hidden states before the teacher's head.
        weight: ``(V, d_t)`` the teacher's head weight: whole (gathered under ZeRO-3/FSDP2), or a DTensor sharded
            over the vocabulary when the teacher is tensor-parallel (each rank keeps its rows).
        bias: its bias, if any.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None


class DistillHeadLoss:
    """The student's head loss (``loss(head, hidden, targets)`` of ``conf/loss``) that distils from a teacher.

    The teacher's outputs for the batch are handed in with :meth:`teacher_batch` around the student's forward; the
    student's head then returns :func:`chunked_distillation_loss` (see ``head_returns_loss``). The last batch's two
    terms are kept in :attr:`last` for logging.

    Args:
        alpha: weight of the KL term.
        temperature: softmax temperature of the KL term.
        kind: ``forward`` or ``reverse`` KL.
        chunk_tokens: tokens per chunk.
        ignore_index: the target id that does not count.

    Example::

        loss = DistillHeadLoss(alpha=0.5, temperature=2.0)
        with loss.teacher_batch(TeacherOutputs(t_hidden, t_weight)), head_returns_loss(lm_head, loss, y):
            value = student(x)
    """

    name = "distill"

    def __init__(
        self,
        alpha: float = 0.5,
        temperature: float = 1.0,
        kind: DistillKind = "forward",
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        ignore_index: int = -100,
    ) -> None:
        check_distill_args(alpha, temperature, kind, chunk_tokens)
        self.alpha, self.temperature, self.kind = float(alpha), float(temperature), kind
        self.chunk_tokens, self.ignore_index = chunk_tokens, ignore_index
        self._teacher: TeacherOutputs | None = None
        self.last: DistillTerms | None = None

    @contextmanager
    def teacher_batch(self, outputs: TeacherOutputs) -> Iterator[None]:
        """While inside, the head loss distils from ``outputs`` (the teacher's forward of the same batch)."""
        self._teacher = outputs
        try:
            yield
        finally:
            self._teacher = None

    def compute(self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss from the head's parameters as they are (call it inside the head's call, where they are gathered).

        Raises:
            RuntimeError: called outside :meth:`teacher_batch`.
        """
        if self._teacher is None:
            raise RuntimeError("DistillHeadLoss needs the teacher's outputs: call it inside teacher_batch(...).")
        t = self._teacher
        weight, bias = head_weight(head, self.name), getattr(head, "bias", None)
        t_hidden = t.hidden[:, : hidden.shape[1]] if t.hidden.dim() == 3 and hidden.dim() == 3 else t.hidden
        settings: dict[str, Any] = {
            "alpha": self.alpha,
            "temperature": self.temperature,
            "kind": self.kind,
            "chunk_tokens": self.chunk_tokens,
            "ignore_index": self.ignore_index,
        }
        if _is_dtensor(weight):
            # Tensor parallelism: the student's head is sharded over the vocabulary and its input replicated; each
            # rank computes its slice of both models' logits, the softmaxes are reduced over the group.
            if bias is not None or t.bias is not None:
                raise ConfigError(
                    "distill",
                    "a head bias",
                    "a head with a bias is not supported under tensor parallelism; use a data-parallel strategy "
                    "(+strategy=fsdp).",
                )
            terms = vocab_parallel_chunked_distillation_loss(hidden, weight, t_hidden, t.weight, targets, **settings)
        else:
            t_weight, t_bias = _whole(t.weight), None if t.bias is None else _whole(t.bias)
            terms = chunked_distillation_loss(
                hidden, weight, t_hidden, t_weight, targets, bias=bias, teacher_bias=t_bias, **settings
            )
        self.last = terms
        return terms.loss

    def __call__(self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss through ``head``'s own call (the strategy gathers its weight), inside :meth:`teacher_batch`."""
        head_weight(head, self.name)
        return run_in_head_call(head, lambda h, t: self.compute(head, h, t), hidden, targets)  # type: ignore[no-any-return]
