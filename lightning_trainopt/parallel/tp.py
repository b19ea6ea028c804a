"""Tensor and sequence parallelism: Megatron-style DTensor plans by module name, applied with ``parallelize_module``.

The plans follow torchtitan's ``apply_tp`` (``parallelize_llama``): in each block q/k/v and gate/up are
column-parallel and o/down row-parallel, so a block's attention and MLP each need one all-gather (sequence ->
whole) in and one reduce-scatter (partial sums -> sequence shards) out; the norms and the residual stream between
blocks are sequence-parallel (each rank holds ``seq_len / tp`` positions, as a DTensor sharded on dimension 1, so
code that reads a shape still sees the whole sequence); the embedding is row-parallel over the vocabulary and the
output head column-parallel with its logits left sharded over the vocabulary, for the loss-parallel cross-entropy
(``torch.distributed.tensor.parallel.loss_parallel``, entered by the strategy around each step and its backward).
Inside attention each rank holds ``n_heads / tp`` query heads and ``kv_heads / tp`` key/value heads: our
:class:`~lightning_trainopt.models.gpt.Attention` has its head counts divided on the instance; Hugging Face's
Llama-family attention reshapes with ``-1`` heads and needs nothing.

An architecture without a plan is refused (:data:`ARCHITECTURES` lists those with one). FP8: with torchao's float8
layers converted first (step 1 of the ordered rewrite), the plans use torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput`` for the blocks, as torchtitan does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_trainopt._compat.torch_internals import head_colwise_parallel
from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.parallel.adapters import adapter_tp_plan

__all__ = [
    "ARCHITECTURES",
    "TPReport",
    "apply_tensor_parallel",
    "architecture_of",
    "clip_grad_norm_",
    "inner_model",
    "model_shape",
    "tp_divisibility_errors",
]

_GPT = "lightning_trainopt.models.gpt.GPT"

#: Architectures with a plan: our GPT presets (``models/gpt.py``) and Hugging Face's Llama family by ``model_type``.
ARCHITECTURES = ("gpt", "llama", "mistral", "qwen2")

# Module names of each plan, relative to the inner model: (embedding, blocks, attention, q, k, v, o, attention norm,
# mlp, gate, up, down, mlp norm, final norm, head).
_NAMES = {
    "gpt": ("embed", "blocks", "attn", "q_proj", "k_proj", "v_proj", "o_proj", "attn_norm", "mlp", "gate_proj",
            "up_proj", "down_proj", "mlp_norm", "norm", "lm_head"),
    "hf": ("model.embed_tokens", "model.layers", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj",
           "input_layernorm", "mlp", "gate_proj", "up_proj", "down_proj", "post_attention_layernorm", "model.norm",
           "lm_head"),
}  # fmt: skip


@dataclass
class TPReport:
    """What :func:`apply_tensor_parallel` did.

    Args:
        architecture: the plan used (one of :data:`ARCHITECTURES`).
        tp: the tensor-parallel size.
        modules: the module names the plan parallelised, relative to the inner model.
        float8: the blocks' linear layers use torchao's float8 plans.
    """

    architecture: str
    tp: int
    modules: list[str] = field(default_factory=list)
    float8: bool = False


def inner_model(module: nn.Module) -> nn.Module:
    """The language model inside ``module`` (a LightningModule's ``model``, or ``module`` itself): our ``GPT``, or a
    Hugging Face model (anything with a ``config.model_type``)."""
    for candidate in module.modules():
        if _is_our_gpt(candidate) or isinstance(getattr(getattr(candidate, "config", None), "model_type", None), str):
            return candidate
    return module


def _is_our_gpt(model: nn.Module) -> bool:
    """``model`` is (a subclass of) our ``models.gpt.GPT``, told by name: the callbacks import the rewrite, and they
    may not import the demo models (an import-linter contract)."""
    return any(f"{c.__module__}.{c.__qualname__}" == _GPT for c in type(model).__mro__)


def architecture_of(model: nn.Module) -> str | None:
    """The plan name for ``model`` (our ``GPT``: ``gpt``; Hugging Face: its ``config.model_type``), ``None`` if it
    has no plan."""
    if _is_our_gpt(model):
        return "gpt"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if model_type in ARCHITECTURES else None


def model_shape(model: nn.Module) -> dict[str, int]:
    """Heads, KV heads, FFN width and vocabulary of a GPT config or a Hugging Face config."""
    cfg: Any = model.config
    if architecture_of(model) == "gpt":
        return {"heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn_hidden, "vocab": cfg.vocab_size}
    return {
        "heads": cfg.num_attention_heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "ffn": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
    }


def tp_divisibility_errors(shape: dict[str, int], tp: int, seq_len: int | None = None) -> list[str]:
    """What of a model's shape the tensor-parallel size ``tp`` does not divide (empty: every size divides).

    Args:
        shape: ``heads``, ``kv_heads``, ``ffn``, ``vocab`` (the model's sizes).
        tp: tensor-parallel size.
        seq_len: the training sequence length (sequence parallelism splits it), ``None``: not checked.
    """
    names = {"heads": "attention heads", "kv_heads": "key/value heads", "ffn": "FFN width", "vocab": "vocabulary"}
    errors = [f"{names[k]} {shape[k]}" for k in names if k in shape and shape[k] % tp]
    if seq_len is not None and seq_len % tp:
        errors.append(f"sequence length {seq_len} (sequence parallelism splits it)")
    return errors


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, float8: bool = False) -> TPReport:
    """Parallelise the language model inside ``module`` over the 1-D device mesh ``tp_mesh``, in place.

    Args:
        module: a LightningModule (or the model itself) holding our ``GPT`` or a Llama-family Hugging Face model.
        tp_mesh: the tensor-parallel dimension of the device mesh.
        float8: the blocks' linear layers were converted to torchao's ``Float8Linear``: use its float8 plans.

    Raises:
        IncompatibleConfigError: no plan for the architecture (the message lists those with one), or a size the TP
            size does not divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = inner_model(module)
    arch = architecture_of(model)
    if arch is None:
        found = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise IncompatibleConfigError(
            {"model": found, "strategy.tensor_parallel_size": int(tp_mesh.size())},
            f"tensor parallelism has no plan for {found}.",
            f"use a model with a plan ({', '.join(ARCHITECTURES)}), or a data-parallel strategy (+strategy=fsdp).",
        )
    tp = int(tp_mesh.size())
    bad = tp_divisibility_errors(model_shape(model), tp)
    if bad:
        raise IncompatibleConfigError(
            {"strategy.tensor_parallel_size": tp},
            f"the model's {', '.join(bad)} not divisible by the tensor-parallel size {tp}.",
            "use a tensor-parallel size that divides the heads, KV heads, FFN width and vocabulary.",
        )
    names = _NAMES["gpt" if arch == "gpt" else "hf"]
    embed, blocks, attn, q, k, v, o, attn_norm, mlp, gate, up, down, mlp_norm, norm, head = names
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    tied = _tied(model, embed, head)
    # SequenceParallel replaces a norm's weight by a new Parameter that requires grad: a frozen base (LoRA) must stay
    # frozen, so what was frozen is frozen again below.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    # The residual stream stays a DTensor sharded over the sequence (use_local_output=False), so a model that reads
    # the sequence length from it (Hugging Face's causal mask and positions) sees the whole length.
    top = {
        embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        norm: SequenceParallel(),
        # ColwiseParallel that lets a head loss's scalar through (loss=chunked_ce, vocabulary-parallel).
        head: head_colwise_parallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp_mesh, top)
    # GPT's attention takes (x, rope, doc_ids); Hugging Face's its hidden states by keyword.
    gather = (
        {"input_layouts": (Shard(1), None, None), "desired_input_layouts": (Replicate(), None, None)}
        if arch == "gpt"
        else {
            "input_kwarg_layouts": {"hidden_states": Shard(1)},
            "desired_input_kwarg_layouts": {"hidden_states": Replicate()},
        }
    )
    block_plan = {
        attn_norm: SequenceParallel(),
        attn: prepare_input(**gather, use_local_output=True),
        f"{attn}.{q}": colwise(),
        f"{attn}.{k}": colwise(),
        f"{attn}.{v}": colwise(),
        f"{attn}.{o}": rowwise(output_layouts=Shard(1), use_local_output=False),
        mlp_norm: SequenceParallel(),
        mlp: prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        f"{mlp}.{gate}": colwise(),
        f"{mlp}.{up}": colwise(),
        f"{mlp}.{down}": rowwise(output_layouts=Shard(1), use_local_output=False),
    }
    layers: Any = model.get_submodule(blocks)  # an nn.ModuleList
    for layer in layers:
        # A peft LoRA layer in place of a linear layer: its base and adapters get their own styles.
        parallelize_module(layer, tp_mesh, adapter_tp_plan(layer, block_plan))
        if arch == "gpt":  # each rank computes its own heads
            layer.get_submodule(attn).n_heads //= tp
            layer.get_submodule(attn).kv_heads //= tp
    if tied:
        # Row-parallel embedding and column-parallel head both shard the (vocab, d_model) matrix on dimension 0:
        # one DTensor serves both, as the tie did before (parallelize_module made a second Parameter of it).
        model.get_submodule(head).weight = model.get_submodule(embed).weight
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return TPReport(
        architecture=arch,
        tp=tp,
        modules=[*top, *(f"{blocks}.{i}.{name}" for i in range(len(layers)) for name in block_plan)],
        float8=float8,
    )


def _tied(model: nn.Module, embed: str, head: str) -> bool:
    return model.get_submodule(head).weight is model.get_submodule(embed).weight


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a mix of DTensor (tensor-parallel, FSDP2) and plain parameters to ``max_norm`` in total.

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails when they are DTensors on
    different meshes or a mix of DTensors and plain tensors (torchtune #2420). Here each DTensor's norm is made whole
    (``full_tensor``: the partial norms of its shards reduced over its mesh) before the norms are combined, so
    every rank gets the same total and scales its shards by the same factor.

    Returns:
        the total norm (a plain scalar tensor).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    total = stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.device, grad.dtype))
    return total
