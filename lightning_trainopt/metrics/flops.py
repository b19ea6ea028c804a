"""Training FLOPs: the analytic transformer formula for :class:`GPTConfig`, and ``torch.utils.flop_counter`` for any
module, counted once on a meta-device copy and fitted to ``B * (c + a*T + b*T^2)`` so that batches of any length
cost no further counting.

Convention (PaLM appendix B, Megatron-LM): only matrix multiplications count, a multiply-add is 2 FLOPs, the backward
pass costs twice the forward, and attention scores/values count the full ``T x T`` product even under a causal mask
(as ``torch.utils.flop_counter`` does). Norms, softmax and element-wise ops are not counted (< 1% here).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from lightning_trainopt._compat.torch_internals import pre_fsdp_class
from lightning_trainopt.metrics.model_shape import GPTConfig

__all__ = [
    "LABEL_KEYS",
    "CallConvention",
    "FlopCount",
    "SeqFlops",
    "TransformerFlops",
    "call_conventions",
    "count_flops",
    "fit_seq_flops",
    "meta_copy",
    "teacher_forward_flops",
    "transformer_flops",
]

#: Batch keys that are targets, never passed to ``forward`` (a module given ``labels`` may compute its own loss).
LABEL_KEYS = frozenset({"labels", "label", "targets", "target", "y"})


@dataclass(frozen=True)
class TransformerFlops:
    """FLOPs of one batch of ``batch_size`` sequences of ``seq_len`` tokens.

    Args:
        forward: model FLOPs of the forward pass.
        block_forward: the part of ``forward`` spent in the transformer blocks.
        attention_forward: the ``QK^T`` and ``AV`` part of ``forward``.
        block_recompute: the part of ``block_forward`` that checkpointing every block replays in backward. Torch's
            non-reentrant checkpoint stops replaying once every saved tensor is rebuilt (early stop, its default),
            so each block's last matmul, the FFN down-projection whose output nothing saves, is not re-run.
    """

    forward: int
    block_forward: int
    attention_forward: int
    block_recompute: int

    @property
    def train(self) -> int:
        """Model FLOPs of forward + backward (3x forward): the numerator of MFU."""
        return 3 * self.forward

    def hardware_train(self, recompute_fraction: float = 0.0) -> int:
        """FLOPs the hardware executes when ``recompute_fraction`` of the blocks are checkpointed (HFU)."""
        return self.train + int(round(recompute_fraction * self.block_recompute))


def transformer_flops(cfg: GPTConfig, seq_len: int, batch_size: int = 1) -> TransformerFlops:
    """Analytic FLOPs of :class:`~lightning_trainopt.models.GPT` for a ``(batch_size, seq_len)`` batch."""
    d, hd = cfg.d_model, cfg.head_dim
    matmul_per_block = d * cfg.n_heads * hd + 2 * d * cfg.kv_heads * hd + cfg.n_heads * hd * d + 3 * d * cfg.ffn_hidden
    tokens = batch_size * seq_len
    # QK^T and AV: 2 * (2 * T * T * head_dim) per head.
    attention = 4 * batch_size * cfg.n_heads * seq_len * seq_len * hd
    block = cfg.n_layers * (2 * matmul_per_block * tokens + attention)
    down_proj = cfg.n_layers * 2 * cfg.ffn_hidden * d * tokens
    head = 2 * d * cfg.vocab_size * tokens
    return TransformerFlops(
        forward=block + head,
        block_forward=block,
        attention_forward=cfg.n_layers * attention,
        block_recompute=block - down_proj,
    )


def teacher_forward_flops(
    samples: int, seq_len: int, config: GPTConfig | None = None, n_params: int | None = None
) -> int:
    """Forward FLOPs of a distillation teacher for a ``(samples, seq_len)`` batch: work done, counted in MFU.

    The teacher runs forward only (no backward, no recompute), so this is added to the student's training FLOPs as
    it is. Our GPT presets are counted analytically (:func:`transformer_flops`); any other model as ``2 x n_params``
    per token (the dense matmuls; attention's ``T^2`` term left out).

    Args:
        samples: sequences in the batch.
        seq_len: tokens per sequence.
        config: the teacher's shape, when it is one of our GPT presets.
        n_params: the teacher's parameter count otherwise.

    Raises:
        ValueError: neither ``config`` nor ``n_params`` given.
    """
    if config is not None:
        return transformer_flops(config, seq_len, samples).forward
    if n_params is None:
        raise ValueError("teacher_forward_flops needs the teacher's config or its parameter count")
    return 2 * n_params * samples * seq_len


def _unwrapped_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The module class before FSDP2 swapped it for its ``FSDP<Name>`` subclass (which refuses to be copied)."""
    if any(c.__name__ == "FSDPModule" for c in cls.__mro__):
        return pre_fsdp_class(cls)
    return cls


def _full_meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s full shape: a DeepSpeed ZeRO-3 placeholder has its real shape in ``ds_shape``, a
    DTensor (an FSDP2 or tensor-parallel shard) its global shape in ``shape``."""
    shape = getattr(t, "ds_shape", None)
    meta = torch.empty(tuple(shape) if shape is not None else tuple(t.shape), dtype=t.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _copy_value(value: Any, memo: dict[int, Any]) -> Any:
    """A deep copy of a module attribute, or the object itself where it cannot be copied (a process group, a lock):
    the meta copy only reads such objects."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = _full_meta(value)
        return memo[id(value)]
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # any object may refuse copying in any way; sharing it is what the copy needs
        return value


def _dequantized_linear(module: nn.Module) -> nn.Linear | None:
    """A meta ``nn.Linear`` in place of a 4-bit linear layer (bitsandbytes' ``Linear4bit``, an ``nn.Linear`` whose
    weight's ``quant_state`` holds the original shape), else ``None``.

    The packed weight cannot run on the meta device (dequantizing reads its quantization state's values), and its
    matmul is the original shape's: the dequantization is elementwise, so the FLOPs are the plain layer's.
    """
    if not isinstance(module, nn.Linear):
        return None
    state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
    shape = getattr(state, "shape", None)
    if shape is None:
        return None
    out_features, in_features = tuple(shape)
    dtype = getattr(module, "compute_dtype", None) or torch.float32
    bias = module.bias is not None
    return nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype).requires_grad_(False)


def _clone(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    if id(module) in memo:  # a module reached twice (weight sharing) stays one module
        return memo[id(module)]
    dequantized = _dequantized_linear(module)
    if dequantized is not None:
        memo[id(module)] = dequantized
        return dequantized
    cls = _unwrapped_class(type(module))
    new = cls.__new__(cls)
    memo[id(module)] = new
    state: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(value, dict):
            state[name] = type(value)() if type(value) in (dict, OrderedDict) else OrderedDict()
        elif name in ("_parameters", "_buffers"):
            state[name] = {k: None if t is None else _copy_value(t, memo) for k, t in value.items()}
        elif name == "_modules":
            state[name] = {k: None if m is None else _clone(m, memo) for k, m in value.items()}
        else:
            state[name] = _copy_value(value, memo)
    new.__dict__.update(state)
    return new


def meta_copy(module: nn.Module, share: tuple[Any, ...] = ()) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory is allocated), without
    any hook.

    Copied this way, any module can be counted however a strategy has wrapped it: the hooks of a sharding engine
    (DeepSpeed ZeRO-3's parameter fetches, FSDP2's all-gathers) are left behind, so counting on the copy never runs
    them (DeepSpeed's fetch trace broke the real step afterwards: ``IndexError: pop from an empty deque``); hooks
    compute no matrix product, so the FLOPs stay the model's. Parameters take their full shape (a ZeRO-3 placeholder
    its ``ds_shape``, an FSDP2 or tensor-parallel DTensor its global shape) and FSDP2's ``FSDP<Name>`` classes go
    back to their own; a 4-bit linear layer (QLoRA) becomes a plain one of its original shape. Objects in ``share``
    (e.g. a LightningModule's Trainer), and attributes that refuse to be
    copied, are referenced by the copy, not copied.
    """
    memo: dict[int, Any] = {id(obj): obj for obj in share}
    return _clone(module, memo)


def _to_meta(obj: Any, shape_of: Callable[[torch.Tensor], list[int]] | None = None) -> Any:
    """``obj`` with every tensor replaced by a meta tensor of the same dtype (and shape, unless ``shape_of`` says)."""
    if isinstance(obj, torch.Tensor):
        shape = shape_of(obj) if shape_of is not None else list(obj.shape)
        return torch.empty(shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_meta(o, shape_of) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_meta(o, shape_of) for o in obj)
    if isinstance(obj, Mapping):
        return {k: _to_meta(v, shape_of) for k, v in obj.items()}
    return obj


def _resized(old: int, new: int, only_dim1: bool) -> Callable[[torch.Tensor], list[int]]:
    """Shape map that sets the sequence dimensions (size ``old``, after the batch dimension) to ``new``."""

    def shape_of(t: torch.Tensor) -> list[int]:
        shape = list(t.shape)
        for i in range(1, min(2, t.dim()) if only_dim1 else t.dim()):
            if shape[i] == old:
                shape[i] = new
        return shape

    return shape_of


def _output_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, Mapping):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        values: Any = out.values()
    elif isinstance(out, (tuple, list)):
        values = out
    else:
        return None
    for value in values:
        found = _output_tensor(value)
        if found is not None:
            return found
    return None


def _default_loss(out: Any) -> torch.Tensor:
    tensor = _output_tensor(out)
    if tensor is None:
        raise TypeError(f"cannot find a tensor to backpropagate in the model output of type {type(out).__name__}")
    return tensor.float().sum()


@dataclass(frozen=True)
class CallConvention:
    """One way to call a module's ``forward`` with a batch.

    Args:
        describe: how it reads in messages, e.g. ``forward(input_ids=, attention_mask=)``.
        split: maps a batch to ``(args, kwargs)``.
    """

    describe: str
    split: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]


def _input_keys(module: nn.Module, batch: Mapping[Any, Any]) -> tuple[str, ...]:
    candidates = [k for k in batch if isinstance(k, str) and k not in LABEL_KEYS]
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): offer every non-label key
        return tuple(candidates)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    keys = [k for k in candidates if k in named]
    if not keys and any(p.kind is p.VAR_KEYWORD for p in params):
        keys = candidates
    return tuple(keys)


def call_conventions(module: nn.Module, batch: Any) -> list[CallConvention]:
    """The ways worth trying to call ``module`` with ``batch``, most likely first.

    A tensor: ``forward(batch)``. A tuple/list: ``forward(batch[0])`` (inputs first, targets after), then
    ``forward(*batch)``, then ``forward(batch)``. A dict: ``forward(**inputs)`` with the keys the signature names
    (every key when it only takes ``**kwargs``) except the :data:`LABEL_KEYS`, then ``forward(batch)``.
    Anything else: ``forward(batch)``.
    """
    whole = CallConvention("forward(batch)", lambda b: ((b,), {}))
    if isinstance(batch, (tuple, list)):
        out = [CallConvention("forward(batch[0])", lambda b: ((b[0],), {}))] if batch else []
        if len(batch) > 1:
            out.append(CallConvention("forward(*batch)", lambda b: (tuple(b), {})))
        return [*out, whole]
    if isinstance(batch, Mapping):
        keys = _input_keys(module, batch)
        if not keys:
            return [whole]
        named = CallConvention(f"forward({', '.join(f'{k}=' for k in keys)})", lambda b: ((), {k: b[k] for k in keys}))
        return [named, whole]
    return [whole]


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one counted call.

    Args:
        total: everything executed: forward, backward and the forward that activation checkpointing recomputes.
        forward: the forward pass alone.
        recomputed: recomputed forward FLOPs inside ``total``; ``None`` when this torch cannot tell them apart.
    """

    total: int
    forward: int
    recomputed: int | None

    @property
    def model(self) -> int:
        """Model FLOPs: ``total`` without recomputation (what MFU counts)."""
        return self.total - (self.recomputed or 0)


def _count(
    model: nn.Module,
    convention: CallConvention,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: bool = True,
    truth_values: bool = False,
) -> FlopCount:
    from lightning_trainopt._compat.torch_internals import MetaTruthValues, RecomputeFlopCounter, builtin_linear

    counter = RecomputeFlopCounter()
    args, kwargs = convention.split(inputs)
    truth = MetaTruthValues() if truth_values else contextlib.nullcontext()
    try:
        with torch.enable_grad(), builtin_linear(), counter, truth:
            out = model(*args, **kwargs)
            if backward:
                loss = (loss_fn or _default_loss)(out)
                counter.start_backward()
                loss.backward()
    finally:
        for p in model.parameters():
            p.grad = None
    return FlopCount(counter.total, counter.forward, counter.recomputed)


def count_flops(
    module: nn.Module,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: bool = True,
    share: tuple[Any, ...] = (),
) -> int:
    """FLOPs of ``module(example_input)`` (and its backward) counted by ``torch.utils.flop_counter`` on a meta copy.

    All executed FLOPs, including the forward that activation checkpointing recomputes in backward (see
    :class:`FlopCount` for the split).

    Args:
        module: any module; it is copied to the meta device, so this costs no memory or compute.
        example_input: a tensor, a tuple/list of positional arguments, or a dict of keyword arguments.
        loss_fn: maps the output to a scalar to backpropagate; default: sum of the logits (first output tensor).
        backward: also count the backward pass.
        share: objects the meta copy references instead of copying (see :func:`meta_copy`).
    """
    if isinstance(example_input, Mapping):
        convention = CallConvention("forward(**input)", lambda b: ((), dict(b)))
    elif isinstance(example_input, (tuple, list)):
        convention = CallConvention("forward(*input)", lambda b: (tuple(b), {}))
    else:
        convention = CallConvention("forward(input)", lambda b: ((b,), {}))
    return _count(meta_copy(module, share), convention, _to_meta(example_input), loss_fn, backward).total


_ZERO3 = (Fraction(0), Fraction(0), Fraction(0))
#: How a call counted with :class:`~._compat.torch_internals.MetaTruthValues` reads in ``SeqFlops.call``.
_TRUTH = " [truth values of meta tensors read as True]"


def _poly(coeffs: tuple[Fraction, Fraction, Fraction], samples: int, seq_len: int | None) -> int:
    c, a, b = coeffs
    t = seq_len or 0
    return round(samples * (c + a * t + b * t * t))


@dataclass(frozen=True)
class SeqFlops:
    """Training FLOPs (forward + backward) of a micro-batch of ``B`` sequences of ``T`` tokens:
    ``B * (c + a*T + b*T^2)``, and the forward FLOPs activation checkpointing recomputes, as a second polynomial.

    Exact for transformers: linear layers cost ``a`` per token, attention scores and values ``b*T`` per token, and
    layers after pooling (a classifier head) ``c`` per sequence. Fitted by :func:`fit_seq_flops`.

    Args:
        per_sequence: ``c``.
        per_token: ``a``.
        per_token_squared: ``b``.
        lengths: the lengths counted: the batch's own, two more for the fit and the last as a check; empty when the
            batch has no sequence dimension (then FLOPs are ``B * c``).
        call: how ``forward`` was called, e.g. ``forward(input_ids=, attention_mask=)``.
        recomputed: ``(c, a, b)`` of the recomputed forward FLOPs (zeros without checkpointing).
        recompute_share: recomputed / forward FLOPs at the batch's own length, 0..1 (the HFU share);
            ``None`` when this torch cannot tell recomputation apart (then ``recomputed`` is zeros).
    """

    per_sequence: Fraction
    per_token: Fraction
    per_token_squared: Fraction
    lengths: tuple[int, ...]
    call: str
    recomputed: tuple[Fraction, Fraction, Fraction] = _ZERO3
    recompute_share: Fraction | None = Fraction(0)

    def applies_to(self, seq_len: int | None) -> bool:
        """Whether batches with this ``seq_len`` (``None``: no sequence dimension) have the fitted structure."""
        return (seq_len is not None) == bool(self.lengths)

    def __call__(self, samples: int, seq_len: int | None) -> int:
        """Model FLOPs (forward + backward, no recomputation) of ``samples`` sequences of ``seq_len`` tokens."""
        return _poly((self.per_sequence, self.per_token, self.per_token_squared), samples, seq_len)

    def hardware(self, samples: int, seq_len: int | None) -> int:
        """Executed FLOPs: model FLOPs plus the forward recomputed by activation checkpointing."""
        return self(samples, seq_len) + _poly(self.recomputed, samples, seq_len)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view for metrics.json."""
        return {
            "per_sequence": float(self.per_sequence),
            "per_token": float(self.per_token),
            "per_token_squared": float(self.per_token_squared),
            "recomputed": [float(x) for x in self.recomputed],
            "recompute_share": None if self.recompute_share is None else float(self.recompute_share),
            "lengths": list(self.lengths),
            "call": self.call,
        }


def _fit_lengths(seq_len: int) -> list[int]:
    """Three lengths besides ``seq_len``, shorter ones first (a learned position table may stop at ``seq_len``)."""
    out: list[int] = []
    for n in (-(-seq_len // 2), -(-seq_len // 4), -(-3 * seq_len // 4), seq_len + 1, seq_len + 2, seq_len + 3):
        if n >= 1 and n != seq_len and n not in out:
            out.append(n)
    return out[:3]


def _quadratic(points: list[tuple[int, Fraction]]) -> tuple[Fraction, Fraction, Fraction]:
    """``(c, a, b)`` of ``c + a*T + b*T^2`` through three ``(T, value)`` points (Newton's divided differences)."""
    (t0, g0), (t1, g1), (t2, g2) = points
    d1 = (g1 - g0) / (t1 - t0)
    d2 = (g2 - g1) / (t2 - t1)
    b = (d2 - d1) / (t2 - t0)
    a = d1 - b * (t0 + t1)
    return g0 - a * t0 - b * t0 * t0, a, b


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


def fit_seq_flops(
    module: nn.Module,
    batch: Any,
    samples: int,
    seq_len: int | None,
    share: tuple[Any, ...] = (),
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    tolerance: float = 0.01,
) -> SeqFlops:
    """Count the training FLOPs of ``module`` on ``batch`` once and fit ``B * (c + a*T + b*T^2)``.

    Model FLOPs and the forward FLOPs that activation checkpointing recomputes (however the module checkpoints:
    our wrapper, torch's ``checkpoint_wrapper``, Hugging Face's ``gradient_checkpointing_enable()`` or its own
    ``torch.utils.checkpoint`` calls) are told apart while counting and fitted separately (see :class:`SeqFlops`).

    One meta-device copy of ``module`` runs forward + backward under ``torch.utils.flop_counter`` at the batch's own
    length and at three others (the batch's tensors resized along their sequence dimensions): three counts fix
    ``c, a, b`` exactly, the fourth must agree within ``tolerance``. The call convention is the first of
    :func:`call_conventions` that runs. Where none runs, they are tried again with yes/no questions about tensor
    values answered ``True`` (:class:`~lightning_trainopt._compat.torch_internals.MetaTruthValues`: Hugging Face's mask
    code asks whether a padding mask has no padding and whether position ids hold packed sequences, to choose a path
    with the same matrix products); ``call`` then says so. Costs a few forward/backward passes on meta tensors, once.

    Args:
        module: the module whose ``forward`` the batch is given to (a LightningModule's ``forward``).
        batch: one real micro-batch; only the shapes and dtypes of its tensors are used.
        samples: ``B``, the leading dimension of the batch's tensors.
        seq_len: ``T``, dimension 1 of its inputs, or ``None`` when it has none (FLOPs are then ``B * c``).
        share: objects the meta copy references instead of copying (see :func:`meta_copy`).
        loss_fn: maps the output to a scalar to backpropagate; default: sum of the logits.
        tolerance: relative disagreement allowed at the check length.

    Raises:
        RuntimeError: no call convention runs on the meta copy (e.g. the forward reads tensor values, which meta
            tensors do not have), or the counts do not follow the polynomial. The message lists each attempt.
    """
    model = meta_copy(module, share)
    errors: list[str] = []
    base: FlopCount | None = None
    # Truth values of meta tensors are answered only where no call runs without them (see MetaTruthValues).
    attempts = [(c, truth) for truth in (False, True) for c in call_conventions(module, batch)]
    for convention, truth in attempts:
        try:
            base = _count(model, convention, _to_meta(batch), loss_fn, truth_values=truth)
        except Exception as err:  # the module's own code may fail in any way on meta tensors: try the next call
            errors.append(f"{convention.describe}{_TRUTH if truth else ''} -> {_first_line(err)}")
            continue
        break
    if base is None:
        raise RuntimeError("; ".join(errors))
    call = f"{convention.describe}{_TRUTH if truth else ''}"
    recompute_share = None if base.recomputed is None else Fraction(base.recomputed, base.forward or 1)
    if seq_len is None:
        return SeqFlops(
            Fraction(base.model, samples),
            Fraction(0),
            Fraction(0),
            (),
            call,
            (Fraction(base.recomputed or 0, samples), Fraction(0), Fraction(0)),
            recompute_share,
        )
    lengths = _fit_lengths(seq_len)
    counts: list[FlopCount] | None = None
    for only_dim1 in (False, True):
        try:
            counts = [
                _count(model, convention, _to_meta(batch, _resized(seq_len, n, only_dim1)), loss_fn, truth_values=truth)
                for n in lengths
            ]
        except Exception as err:  # as above: a resize this module does not accept
            errors.append(f"{call} at lengths {lengths} -> {_first_line(err)}")
            continue
        break
    if counts is None:
        raise RuntimeError(f"{call} runs at T={seq_len} only: " + "; ".join(errors))
    counted = [(seq_len, base), *zip(lengths, counts)]
    model_points = [(t, Fraction(c.model, samples)) for t, c in counted]
    recompute_points = [(t, Fraction(c.recomputed or 0, samples)) for t, c in counted]
    fit = SeqFlops(
        *_quadratic(model_points[:3]),
        tuple(t for t, _ in counted),
        call,
        _quadratic(recompute_points[:3]),
        recompute_share,
    )
    check_len, check = lengths[-1], counts[-1]
    for what, predicted, actual in (
        ("", fit(samples, check_len), check.model),
        ("recomputed ", fit.hardware(samples, check_len) - fit(samples, check_len), check.recomputed or 0),
    ):
        if abs(predicted - actual) > tolerance * abs(actual):
            raise RuntimeError(
                f"the {what}FLOPs of {call} do not follow B*(c + a*T + b*T^2): counted {actual} at "
                f"T={check_len}, the fit through T={list(fit.lengths[:3])} predicts {predicted}"
            )
    return fit
