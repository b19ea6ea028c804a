"""Analytic bytes saved for backward by the demo transformer (:class:`~lightning_trainopt.models.GPT`).

Derived op by op from ``models/gpt.py`` (what each autograd node keeps, counted once per storage, parameters apart
— the same rules as :mod:`lightning_trainopt.metrics.saved_tensors`), per token and per block, with ``a`` the bytes of
the compute dtype:

- each RMSNorm: its fp32 input (``x.float()``), ``rsqrt`` (1 value) and the normalised fp32 tensor: ``8d + 4``;
- linear inputs: ``a·d`` per distinct input; under autocast every ``Linear`` casts its input again
  (3 copies for q/k/v, 2 for gate/up), without autocast q/k/v share one;
- attention with SDPA's flash / memory-efficient kernels: rotated q and k, v, the output and the o_proj input:
  ``a·(3d + 2·d_kv)``, plus the fp32 log-sum-exp ``4·H``; with the ``math`` kernel (measured on fake tensors under
  ``sdpa_kernel(MATH)``, fp32, bf16 autocast and bf16 weights, MHA and GQA): q, k and v upcast to fp32 with k and v
  expanded to all heads (``4·3d``; torch upcasts half inputs unless ``allow_fp16_bf16_reduction_math_sdp``), the fp32
  probabilities ``4·H·T`` (the quadratic term that flash kernels remove) and the o_proj input ``a·d`` — no kernel
  output and no log-sum-exp;
- SwiGLU: gate output, ``silu(gate)``, up output and their product: ``4·F·a``.

Outside the blocks: token ids (8 B), the final norm (``8d + 4``), the lm_head input (``a·d``), the fp32 log-softmax
of the loss (``4·V``), the targets (8 B) and one rotary table (``4·T·head_dim`` per micro-batch). Under autocast
the half copies of every ``Linear`` weight are saved too (2 B per weight element).

The loss (``loss=``): ``chunked`` (``transforms/chunked_loss.py``) keeps the final norm's output in the residual
stream's dtype (``s·d``) and one fp32 log-sum-exp per token (``4``) instead of the lm_head input and the log-softmax,
and no half copy of the lm_head weight (it runs outside autocast); backward holds one chunk's logits and an fp32
weight-gradient accumulator. ``liger`` (Liger-Kernel, read from its source, GPU only) writes the gradients in
forward and keeps them: the hidden states' gradient (``s·d``) and the head weight's (``V·d`` in the weight dtype).

Techniques: non-reentrant checkpointing keeps only each checkpointed block's input (``s·d``, ``s`` the residual
stream's bytes); ``every_k`` checkpoints blocks 0, k, 2k, ...; 8-bit compression stores floating tensors of at
least ``min_numel`` elements as int8 (padded to whole blocks) plus an fp32 scale per ``block`` elements
(``transforms/compression.py``); offload moves saved storages of at least ``min_numel`` elements to pinned CPU
memory, each block rounded up to a power of two by torch's caching host allocator (``transforms/offload.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner.precision_plan import LossPlan
from lightning_trainopt.planner.terms import MemoryEstimate, Term

__all__ = [
    "ActivationPolicy",
    "compressed_bytes",
    "estimate_transformer_activations",
    "loss_transient",
    "pinned_rounding_term",
    "placed_bytes",
    "recomputed_block_term",
]

_ATTENTION = ("sdpa", "math")


@dataclass(frozen=True)
class ActivationPolicy:
    """How saved activations are treated (plain data, built from ``cfg.activations``).

    Args:
        checkpoint_every: 0 for none, 1 to checkpoint every block, k for blocks 0, k, 2k, ...
        offload: saved tensors go to CPU memory.
        compress_bits: 8 for int8 compression of saved tensors, ``None`` for none.
        compress_block: elements per fp32 scale of the compression.
        compress_min_numel: smaller tensors are stored uncompressed.
        name: preset name for reports.
        offload_pin_memory: offloaded tensors go to pinned memory (the ``offload`` preset's ``pin_memory``), whose
            allocator rounds each block up to a power of two.
        offload_min_numel: storages below this many elements stay on the device (the preset's ``min_numel``).
    """

    checkpoint_every: int = 0
    offload: bool = False
    compress_bits: int | None = None
    compress_block: int = 64
    compress_min_numel: int = 1024
    name: str = "none"
    offload_pin_memory: bool = True
    offload_min_numel: int = 1024

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ConfigError("activations.every_k", self.checkpoint_every, "use 0 (none), 1 (all) or k >= 2.")
        if self.offload_min_numel < 1:
            raise ConfigError(
                "activations.activation_offload.min_numel", self.offload_min_numel, "use a positive integer, e.g. 1024."
            )
        if self.compress_bits not in (None, 8):
            raise ConfigError("activations.bits", self.compress_bits, "the planner models int8 compression (bits=8).")


def compressed_bytes(nbytes_per_elem: int, numel: int, policy: ActivationPolicy) -> int:
    """Bytes one saved floating tensor of ``numel`` elements occupies under the policy."""
    if policy.compress_bits is None or numel < policy.compress_min_numel:
        return nbytes_per_elem * numel
    blocks = math.ceil(numel / policy.compress_block)
    return blocks * policy.compress_block + 4 * blocks  # int8 codes padded to whole blocks + fp32 scales


def recomputed_block_term(nbytes: int, formula: str) -> Term:
    """The device bytes of one checkpointed block that backward re-runs, held while its gradient is computed.

    Args:
        nbytes: the block's activations.
        formula: how they were found (analytically, or measured with and without checkpointing).
    """
    return Term("other", "device", "recomputed block (backward)", nbytes, formula, phase="backward")


def pinned_rounding_term(rounded: int, of: str) -> Term:
    """The host bytes torch's pinned allocator adds by rounding each offloaded block up to a power of two.

    Args:
        rounded: the bytes added over all offloaded blocks.
        of: what was offloaded, for the formula (``tensors`` analytically, ``storages`` when measured).
    """
    return Term(
        "other",
        "cpu",
        "pinned blocks rounded up to powers of two (CachingHostAllocator)",
        rounded,
        f"sum over offloaded {of} of 2^ceil(log2 bytes) - bytes",
        phase="backward",
    )


def placed_bytes(tensors: list[tuple[int, int]], policy: ActivationPolicy) -> tuple[int, int, int]:
    """(bytes kept on the device, bytes offloaded, pinned round-up) of saved tensors given as (bytes, elements).

    ``CpuOffloader`` leaves storages under ``offload_min_numel`` elements where they are and copies the rest into
    ``torch.empty(..., pin_memory=True)``, whose CachingHostAllocator (torch 2.13 ``ATen/core/CachingHostAllocator.h``,
    ``PowerOf2Ceil`` below ``pinned_max_round_threshold``, unlimited by default) hands out a power-of-two block for
    each and keeps the blocks cached between steps.
    """
    if not policy.offload:
        return sum(b for b, _ in tensors), 0, 0
    moved = [b for b, k in tensors if k >= policy.offload_min_numel]
    kept = sum(b for b, k in tensors if k < policy.offload_min_numel)
    pad = sum((1 << (b - 1).bit_length()) - b for b in moved if b) if policy.offload_pin_memory else 0
    return kept, sum(moved), pad


def estimate_transformer_activations(
    cfg: GPTConfig,
    micro_batch: int,
    seq_len: int,
    compute_bytes: int,
    autocast: bool,
    policy: ActivationPolicy | None = None,
    attention: str = "sdpa",
    loss: LossPlan | None = None,
) -> MemoryEstimate:
    """Bytes saved for backward by one micro-batch, on one device, plus the backward-time transient.

    Args:
        cfg: the model's shape.
        micro_batch: sequences per device per forward.
        seq_len: tokens per sequence.
        compute_bytes: 2 for bf16/fp16 compute, 4 for fp32.
        autocast: ``True`` under Lightning's ``*-mixed`` precision (fp32 weights, autocast casts per op).
        policy: checkpointing / offload / compression.
        attention: ``sdpa`` (flash or memory-efficient kernel, linear in T) or ``math`` (keeps the T x T scores).
        loss: the loss after the head (``None``: logits and ``F.cross_entropy``).

    Raises:
        ConfigError: bad micro-batch, sequence length or attention kernel.
    """
    policy = policy or ActivationPolicy()
    if micro_batch < 1:
        raise ConfigError("data.batch_size", micro_batch, "use a positive micro-batch size.")
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ConfigError("data.seq_len", seq_len, f"use 1..model.max_seq_len={cfg.max_seq_len}.")
    if attention not in _ATTENTION:
        raise ConfigError("plan.attention", attention, f"use one of {', '.join(_ATTENTION)}.")
    a, d, f, h = compute_bytes, cfg.d_model, cfg.ffn_hidden, cfg.n_heads
    dkv = cfg.kv_heads * cfg.head_dim
    bt = micro_batch * seq_len
    stream = 4 if (autocast or a == 4) else 2

    def saved(elem: int, numel: int) -> int:
        return compressed_bytes(elem, numel, policy)

    # One block's saved tensors, as (bytes per element, elements) of each distinct tensor.
    block_tensors = [(4, bt * d), (4, bt), (4, bt * d)] * 2  # two RMSNorms: fp32 input, rsqrt, normalised
    block_tensors += [(a, bt * d)] * ((3 if autocast else 1) + (2 if autocast else 1))  # linear inputs
    if attention == "math":
        block_tensors += [(4, bt * d)] * 3 + [(4, micro_batch * h * seq_len * seq_len), (a, bt * d)]
    else:
        block_tensors += [
            (a, bt * d),
            (a, bt * dkv),
            (a, bt * dkv),
            (a, bt * d),
            (a, bt * d),
            (4, micro_batch * h * seq_len),
        ]
    block_tensors += [(a, bt * f)] * 4
    full_block = sum(saved(e, k) for e, k in block_tensors)
    n_ckpt = 0 if policy.checkpoint_every == 0 else math.ceil(cfg.n_layers / policy.checkpoint_every)
    n_full = cfg.n_layers - n_ckpt
    per_tok = (full_block / bt) if bt else 0
    # (label, formula, copies, saved tensors as (bytes, elements)); each group is placed tensor by tensor below.
    groups: list[tuple[str, str, int, list[tuple[int, int]]]] = [
        (
            f"{n_full} full blocks",
            f"{n_full} x {bt:,} tok x {per_tok:,.0f} B",
            n_full,
            [(saved(e, k), k) for e, k in block_tensors],
        ),
        (
            f"{n_ckpt} checkpointed block inputs",
            f"{n_ckpt} x {bt:,} tok x {stream} B x {d}",
            n_ckpt,
            [(saved(stream, bt * d), bt * d)],
        ),
        _head_group(cfg, bt, a, stream, loss, saved),
        (
            "token ids, targets, rotary table",
            "16 B/tok + 4 B x T x head_dim + loss weight",
            1,
            [(8 * bt, bt)] * 2
            + [(saved(4, seq_len * cfg.head_dim), seq_len * cfg.head_dim)]
            + ([(4, 1)] if loss is None or loss.kind == "standard" else []),  # F.cross_entropy's total weight
        ),
    ]
    if autocast:
        # One half copy per Linear weight, each its own saved tensor (so compressed one by one under int8). The
        # chunked and Liger losses run the head outside autocast: no copy of its weight.
        block_mats = [d * d, d * dkv, d * dkv, d * d, d * f, d * f, f * d]
        head = cfg.vocab_size * d if loss is None or loss.kind == "standard" else 0
        n_w = head + n_full * sum(block_mats)
        copies = [(saved(2, head), head)] if head else []
        copies += [(saved(2, k), k) for k in block_mats] * n_full
        where = "lm_head + full blocks" if head else "full blocks"
        groups.append(("autocast half weight copies", f"2 B x {n_w:,} ({where})", 1, copies))
    if a == 2 and not autocast:
        # Half-precision weights: each RMSNorm multiplies by ``weight.float()``, an fp32 copy saved for backward.
        n_norms = 2 * n_full + 1
        groups.append(("fp32 copies of norm weights", f"{n_norms} x 4 B x d", n_norms, [(saved(4, d), d)]))
    terms: list[Term] = []
    rounded = 0
    for label, formula, count, tensors in groups:
        kept, moved, pad = placed_bytes(tensors, policy)
        stays = f"{label} (storages < {policy.offload_min_numel} elements, not offloaded)" if policy.offload else label
        terms.append(Term("activations", "device", stays, count * kept, formula))
        terms.append(Term("activations", "cpu", label, count * moved, formula))
        rounded += count * pad
    if rounded:
        terms.append(pinned_rounding_term(rounded, "tensors"))
    if n_ckpt:
        # Backward re-runs one checkpointed block and holds its activations while its gradient is computed.
        terms.append(recomputed_block_term(full_block, "one block's activations"))
    terms.append(loss_transient(cfg, bt, a, loss))
    # Saved activations live from the forward to their backward: the backward phase of the step.
    return MemoryEstimate.of(replace(t, phase="backward") if t.category == "activations" else t for t in terms)


def _head_group(
    cfg: GPTConfig, bt: int, a: int, stream: int, loss: LossPlan | None, saved: Callable[[int, int], int]
) -> tuple[str, str, int, list[tuple[int, int]]]:
    """The saved tensors of the final norm, the head and the loss, as (bytes, elements)."""
    d, v = cfg.d_model, cfg.vocab_size
    norm = [(saved(4, bt * d), bt * d)] * 2 + [(4 * bt, bt)]
    kind = "standard" if loss is None else loss.kind
    if kind == "chunked":
        # The norm's output (the residual stream's dtype), one fp32 log-sum-exp per token, the int64 token count.
        tensors = norm + [(saved(stream, bt * d), bt * d), (saved(4, bt), bt), (8, 1)]
        return "final norm, hidden states, log-sum-exp (chunked loss)", f"{bt:,} tok x (8d+4+s·d+4) + 8", 1, tensors
    if kind == "liger":
        # Liger writes both gradients in forward and keeps them: the hidden states' and the head weight's.
        w = 2 if (a == 2 and stream == 2) else 4
        tensors = norm + [(saved(stream, bt * d), bt * d), (saved(w, v * d), v * d)]
        return "final norm, Liger's saved gradients", f"{bt:,} tok x (8d+4+s·d) + {w} B x V x d", 1, tensors
    tensors = norm + [(saved(a, bt * d), bt * d), (saved(4, bt * v), bt * v)]
    return "final norm, lm_head input, log-softmax", f"{bt:,} tok x (8d+4+a·d+4V)", 1, tensors


def loss_transient(cfg: GPTConfig, bt: int, a: int, loss: LossPlan | None) -> Term:
    """What the loss holds at once in backward: the logits and their gradient, or one chunk's (``bt`` tokens of one
    micro-batch, ``a`` bytes of the compute dtype)."""
    v, d = cfg.vocab_size, cfg.d_model
    kind = "standard" if loss is None else loss.kind
    if loss is None or kind == "standard":
        return Term(
            "other",
            "device",
            "logits + their gradient",
            (a + 4) * bt * v,
            f"{bt:,} tok x (a+4) B x V",
            phase="backward",
        )
    if kind == "chunked":
        # Per chunk: the logits (a), their fp32 copy (a half dtype only), minus the log-sum-exp and its exp (fp32),
        # alive together in one expression; and the fp32 weight-gradient accumulator for the whole backward.
        c = min(loss.chunk_tokens, bt)
        per = a + 8 + (4 if a != 4 else 0)
        return Term(
            "other",
            "device",
            "one chunk's logits + fp32 head-gradient accumulator (chunked loss)",
            per * c * v + 4 * v * d,
            f"{per} B x {c:,} tok x V + 4 B x V x d",
            phase="backward",
        )
    # Liger: chunks of 2^ceil(log2(BT / ceil(V / d))) tokens, each chunk's logits and their fp32 gradient.
    c = min(bt, 1 << max(0, math.ceil(math.log2(max(1, bt / math.ceil(v / d))))))
    return Term(
        "other",
        "device",
        "one chunk's logits + gradient (Liger, derived)",
        (a + 4) * c * v,
        f"(a+4) B x {c:,} tok x V",
        phase="backward",
    )
