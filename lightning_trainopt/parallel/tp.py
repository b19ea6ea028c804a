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
``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput`` for the blocks, as torchtitan does. With sequence
parallelism those all-gather float8 activations, which only NCCL can; ``sequence_parallel=False`` (Megatron's
original TP: replicated residual stream and norms, row-parallel outputs all-reduced in high precision) keeps every
float8 tensor out of the collectives, so FP8 tensor parallelism runs on gloo too.
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
from lightning_trainopt.planner.tp_shape import TP_HF_ARCHITECTURES, TPShape, tp_divisibility_errors

__all__ = [
    "ARCHITECTURES",
    "TPReport",
    "apply_tensor_parallel",
    "architecture_of",
    "check_float8_sequence_parallel",
    "check_teacher_tensor_parallel",
    "clip_grad_norm_",
    "inner_model",
    "model_shape",
    "tp_divisibility_errors",
    "tp_shape",
    "tp_sharded_parameters",
]

_GPT = "lightning_trainopt.models.gpt.GPT"

#: Architectures with a plan: our GPT presets (``models/gpt.py``) and Hugging Face's Llama family by ``model_type``.
ARCHITECTURES = ("gpt", *TP_HF_ARCHITECTURES)

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
        sequence_parallel: the norms and the residual stream are split over the sequence too.
    """

    architecture: str
    tp: int
    modules: list[str] = field(default_factory=list)
    float8: bool = False
    sequence_parallel: bool = True


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


def check_teacher_tensor_parallel(teacher: nn.Module, tp: int, path: str | None = None) -> None:
    """Refuse a distillation teacher that the student's tensor-parallel plan cannot split over ``tp`` ranks.

    The one rule for both callers: the launching process's check of the teacher read from ``distill.teacher``
    (built on the meta device, ``config/distill.py``), before anything is spawned, and the TP step of the ordered
    rewrite (``parallel/apply.py``), before the teacher is split.

    Args:
        teacher: the teacher model (our ``GPT`` or a Hugging Face model; the meta device will do).
        tp: the tensor-parallel size.
        path: ``distill.teacher`` as given, named in the message when known.

    Raises:
        IncompatibleConfigError: naming ``distill.teacher`` and ``strategy.tensor_parallel_size``: an architecture
            without a plan, or heads, KV heads, FFN width or vocabulary ``tp`` does not divide.
    """
    inner = inner_model(teacher)
    arch = architecture_of(inner)
    bad = [] if arch is None else tp_divisibility_errors(model_shape(inner), tp)
    if arch is None or bad:
        found = getattr(getattr(inner, "config", None), "model_type", None) or type(inner).__name__
        why = "has no tensor-parallel plan" if arch is None else f"has sizes not divisible by {tp}: {', '.join(bad)}"
        raise IncompatibleConfigError(
            {"distill.teacher": path or found, "strategy.tensor_parallel_size": tp},
            f"the distillation teacher is split by the student's tensor-parallel plan, and its architecture "
            f"({found}) {why}.",
            "use a teacher whose heads, KV heads, FFN width and vocabulary the TP size divides (and an architecture "
            f"with a plan: {', '.join(ARCHITECTURES)}), a smaller strategy.tensor_parallel_size, or +strategy=fsdp.",
        )


def tp_shape(model: nn.Module) -> TPShape | None:
    """What the plan for ``model`` splits, for the planner (``None``: no plan for its architecture)."""
    arch = architecture_of(model)
    if arch is None:
        return None
    cfg: Any = model.config
    s = model_shape(model)
    hidden, layers = (cfg.d_model, cfg.n_layers) if arch == "gpt" else (cfg.hidden_size, cfg.num_hidden_layers)
    return TPShape(arch, hidden, s["heads"], s["kv_heads"], s["ffn"], s["vocab"], layers)


def tp_sharded_parameters(model: nn.Module) -> set[int]:
    """``id`` of each parameter of ``model`` that :func:`apply_tensor_parallel` splits over the TP ranks (the rest,
    norm vectors and row-parallel biases, stay whole on each): read from the plan's module names, without a mesh,
    so the planner counts a rank's share of a meta model as the rewrite will cut it.

    Column-parallel layers (q/k/v, gate/up, the head) shard weight and bias; row-parallel ones (o, down, the
    embedding) shard the weight and replicate the bias (torch's ``RowwiseParallel``).
    """
    arch = architecture_of(model)
    if arch is None:
        return set()
    embed, blocks, attn, q, k, v, o, _, mlp, gate, up, down, _, _, head = _NAMES["gpt" if arch == "gpt" else "hf"]
    # (module, column-parallel): a column-parallel layer splits its bias too, a row-parallel one keeps it whole.
    targets: list[tuple[nn.Module, bool]] = [(model.get_submodule(head), True), (model.get_submodule(embed), False)]
    layers: Any = model.get_submodule(blocks)
    for layer in layers:
        targets += [(layer.get_submodule(f"{attn}.{n}"), True) for n in (q, k, v)]
        targets += [(layer.get_submodule(f"{mlp}.{n}"), True) for n in (gate, up)]
        targets += [(layer.get_submodule(f"{attn}.{o}"), False), (layer.get_submodule(f"{mlp}.{down}"), False)]
    out: set[int] = set()
    for mod, column in targets:
        out.update(id(p) for n, p in mod.named_parameters(recurse=False) if column or n == "weight")
    return out


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: Any, float8: bool = False, sequence_parallel: bool = True, compiled: bool = False
) -> TPReport:
    """Parallelise the language model inside ``module`` over the 1-D device mesh ``tp_mesh``, in place.

    Args:
        module: a LightningModule (or the model itself) holding our ``GPT`` or a Llama-family Hugging Face model.
        tp_mesh: the tensor-parallel dimension of the device mesh.
        float8: the blocks' linear layers were converted to torchao's ``Float8Linear``: use its float8 plans.
        sequence_parallel: split the norms and the residual stream over the sequence too (Megatron's sequence
            parallelism). ``False``: the residual stream is replicated, each block's input goes to the
            column-parallel layers as it is and the row-parallel outputs are all-reduced (in high precision), so
            no collective carries a float8 tensor.
        compiled: the blocks will be compiled (step 4): the embedding then hands them a settled copy of its output
            (:func:`_settled_output`); eager blocks skip that copy.

    Raises:
        IncompatibleConfigError: no plan for the architecture (the message lists those with one), or a size the TP
            size does not divide.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
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
    embed, blocks, attn, head = names[0], names[1], names[2], names[-1]
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    if float8 and sequence_parallel:
        check_float8_sequence_parallel(tp_mesh)
    tied = _tied(model, embed, head)
    # SequenceParallel replaces a norm's weight by a new Parameter that requires grad: a frozen base (LoRA) must stay
    # frozen, so what was frozen is frozen again below.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if sequence_parallel:
        top, block_plan = _sequence_parallel_plans(arch, names, colwise, rowwise, prepare_input)
    else:
        top, block_plan = _replicated_plans(names, colwise, rowwise)
    parallelize_module(model, tp_mesh, top)
    if compiled:  # only compiled blocks need it; eager blocks take the pending collective as it is
        model.get_submodule(embed).register_forward_hook(_settled_output)
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
        sequence_parallel=sequence_parallel,
    )


def _sequence_parallel_plans(
    arch: str, names: tuple[str, ...], colwise: Any, rowwise: Any, prepare_input: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plans with sequence parallelism: the residual stream and the norms sharded over the sequence; each block's
    attention and MLP all-gather their input (in float8 with torchao's plans) and reduce-scatter their output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    embed, _, attn, q, k, v, o, attn_norm, mlp, gate, up, down, mlp_norm, norm, head = names
    # The residual stream stays a DTensor sharded over the sequence (use_local_output=False), so a model that reads
    # the sequence length from it (Hugging Face's causal mask and positions) sees the whole length.
    top = {
        embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        norm: SequenceParallel(),
        # ColwiseParallel that lets a head loss's scalar through (loss=chunked_ce, vocabulary-parallel).
        head: head_colwise_parallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
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
    return top, block_plan


def _replicated_plans(names: tuple[str, ...], colwise: Any, rowwise: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plans without sequence parallelism (Megatron's original TP): the residual stream and the norms replicated
    as plain tensors; column-parallel layers take the replicated input as it is, row-parallel layers all-reduce their
    partial sums in the activations' precision. Only the embedding's output and the row-parallel outputs are reduced
    (forward), and the column-parallel inputs' gradients (backward): never a float8 tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    embed, _, attn, q, k, v, o, _, mlp, gate, up, down, _, _, head = names
    top = {
        embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        head: head_colwise_parallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    }
    block_plan = {
        f"{attn}.{q}": colwise(),
        f"{attn}.{k}": colwise(),
        f"{attn}.{v}": colwise(),
        f"{attn}.{o}": rowwise(),
        f"{mlp}.{gate}": colwise(),
        f"{mlp}.{up}": colwise(),
        f"{mlp}.{down}": rowwise(),
    }
    return top, block_plan


def check_float8_sequence_parallel(tp_mesh: Any) -> None:
    """Refuse torchao's float8 plans with sequence parallelism on a mesh whose backend cannot move float8 tensors.

    With sequence parallelism, ``PrepareFloat8ModuleInput`` casts each block's sequence shard to float8 before the
    all-gather (half the bytes of bf16), and the row-parallel outputs' gradients are all-gathered in float8 in
    backward. NCCL has float8 types; gloo (CPU) has none and fails with ``Invalid scalar type``.

    Raises:
        IncompatibleConfigError: the tensor-parallel mesh's process group is not NCCL.
    """
    import torch.distributed as dist

    backend = str(dist.get_backend(tp_mesh.get_group())) if dist.is_initialized() else "none"
    if "nccl" in backend:
        return
    raise IncompatibleConfigError(
        {"precision": "fp8", "strategy.sequence_parallel": True, "backend": backend},
        f"with sequence parallelism torchao's float8 tensor-parallel plans all-gather float8 activations, and the "
        f"{backend} backend has no float8 type (only NCCL can all-gather float8: GPUs).",
        "set strategy.sequence_parallel=false (FP8 tensor parallelism without float8 collectives), or run on GPUs.",
    )


def _settled_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output with its collective finished, as a tensor (or DTensor) with storage of its own.

    RowwiseParallel reduces the embedding's partial sums asynchronously, so its output holds a pending collective
    (torch's ``AsyncCollectiveTensor``, as the DTensor's local tensor with sequence parallelism, as the tensor itself
    without). A compiled block traced with that wrapper as its input records it as such, and fails when the same
    block is later called with a plain tensor (the next block, or a forward without grad, which recompiles):
    AOTAutograd's runtime wrapper reads the wrapper's ``elem`` (``AttributeError: 'Tensor' object has no attribute
    'elem'``, torch 2.13, at the first validation; ``'_local_tensor'`` without sequence parallelism). With Inductor
    a wrapper nested in a DTensor is also never waited for (pytorch/pytorch#180614). The copy costs one
    ``(batch, seq / tp, d_model)`` activation per step; the first block waits for the collective anyway.
    """
    return output.clone()


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
