"""Which layers of a model run in FP8, which stay in bf16 or fp32, and why: pure decisions over module names.

The shape thresholds are torchao's measured break-even sizes: below them an FP8 layer is slower than bf16, because
the casts to FP8 and the scale computations cost more than the faster GEMM saves. Source: torchao
``torchao/float8/float8_linear_utils.py`` ``_auto_filter_for_tensorwise`` / ``_auto_filter_for_rowwise`` (torchao
0.18), from the benchmark tables in https://github.com/pytorch/ao/tree/main/torchao/float8#performance (H100;
other GPUs differ). FP8 GEMMs need both dimensions divisible by 16 (``torch._scaled_mm``'s constraint).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from torch import nn

from lightning_trainopt._compat.torch_internals import pre_fsdp_class

__all__ = [
    "NOT_FP8_CAUSES",
    "LayerDecision",
    "clean_name",
    "matching_pattern",
    "output_projections",
    "own_class_name",
    "plan_layers",
    "shape_skip_reason",
]

Action = Literal["fp8", "bf16", "fp32"]

#: Why a linear layer does not run in FP8 (``LayerDecision.cause``): in words, and the setting that changes it
#: (``None``: no setting does). The run summary counts layers by cause, so that a run that converts nothing says why.
NOT_FP8_CAUSES: dict[str, tuple[str, str | None]] = {
    "below_break_even": ("below torchao's break-even size, where FP8 is slower", "precision.skip_small=false"),
    "not_divisible_by_16": ("dimensions not divisible by 16", None),
    "output_projection": ("output projection", "precision.convert_lm_head=true"),
    "excluded": ("named by precision.exclude", "precision.exclude"),
    "not_included": ("not named by precision.include", "precision.include"),
    "keep_fp32": ("kept in fp32 by precision.keep_fp32", "precision.keep_fp32"),
    "te_norm": ("replaced by Transformer Engine's norm", None),
}

# Parts of a module path that wrappers insert (torch.compile, activation checkpoint wrappers, FSDP1): a user's glob
# and the report name the module as the model defines it.
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
#: The output projection's name in our GPT, LLaMA/GPT-2/Mistral in Hugging Face, and GPT-NeoX.
_OUTPUT_NAMES = ("lm_head", "embed_out")


@dataclass(frozen=True)
class LayerDecision:
    """What happens to one module.

    Args:
        name: the module's name in the LightningModule (wrapper parts removed).
        kind: its class name.
        shape: ``(out_features, in_features)`` of a linear layer, ``None`` for other modules.
        action: ``fp8`` (converted), ``bf16`` (kept under bf16 autocast) or ``fp32`` (kept in fp32, autocast off).
        reason: why, in words.
        cause: why it is not in FP8, a key of :data:`NOT_FP8_CAUSES` (``""`` when it is, or without an FP8 recipe).
    """

    name: str
    kind: str
    shape: tuple[int, int] | None
    action: Action
    reason: str
    cause: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = None if self.shape is None else list(self.shape)
        return out


def clean_name(name: str) -> str:
    """``name`` without the parts wrappers insert (``model._orig_mod.blocks.0`` -> ``model.blocks.0``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def own_class_name(module: nn.Module) -> str:
    """The module's class name, before FSDP2 swapped its class for ``FSDP<Name>``."""
    return pre_fsdp_class(type(module)).__name__


def matching_pattern(name: str, kind: str, patterns: Iterable[str]) -> str | None:
    """The first pattern that names this module, else ``None``.

    A pattern matches the class name (``RMSNorm``; a glob too: ``*RMSNorm`` for ``LlamaRMSNorm``), or the module name
    as an ``fnmatch`` glob, either whole (``model.blocks.0.mlp.*``) or at its end from a ``.`` boundary (``lm_head``
    matches ``model.lm_head``, ``*.router`` matches ``model.blocks.3.moe.router``). Case matters.
    """
    for pattern in patterns:
        if (
            fnmatch.fnmatchcase(kind, pattern)
            or fnmatch.fnmatchcase(name, pattern)
            or fnmatch.fnmatchcase(name, f"*.{pattern}")
        ):
            return pattern
    return None


def output_projections(root: nn.Module) -> set[int]:
    """``id()`` of the modules that produce the logits: a Hugging Face model's ``get_output_embeddings()``, a linear
    layer named ``lm_head``/``embed_out``, and a linear layer whose weight is an embedding's (tied)."""
    found: set[int] = set()
    embeddings = {id(m.weight) for m in root.modules() if isinstance(m, nn.Embedding)}
    for name, module in root.named_modules():
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter) and isinstance(module, nn.Module) and module is not root:
            out = getter()
            if isinstance(out, nn.Module):
                found.add(id(out))
        if isinstance(module, nn.Linear) and (
            name.rsplit(".", 1)[-1] in _OUTPUT_NAMES or id(module.weight) in embeddings
        ):
            found.add(id(module))
    return found


def shape_skip_reason(out_features: int, in_features: int, recipe: str, skip_small: bool) -> str | None:
    """Why a linear layer of this shape stays in bf16, or ``None`` when FP8 suits it.

    Args:
        out_features: N, the weight's first dimension.
        in_features: K, the weight's second dimension.
        recipe: the torchao recipe (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``) or a Transformer Engine one
            (``delayed``/``current``: per-tensor scaling, so the tensorwise thresholds apply).
        skip_small: apply the break-even thresholds (else only the divisibility rule).
    """
    n, k = out_features, in_features
    if _not_divisible(n, k):
        return f"dimensions {n}x{k} not divisible by 16 (FP8 GEMMs need multiples of 16)"
    if not skip_small:
        return None
    if recipe.startswith("rowwise"):
        # torchao _auto_filter_for_rowwise (H100 measurements, torchao/float8 README "rowwise scaling").
        if n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048):
            return (
                f"{n}x{k} is below torchao's rowwise break-even size (N > 2048, K > 1024, not both N <= 4096 and "
                "K <= 2048): FP8 would be slower (precision.skip_small=false converts it anyway)"
            )
        return None
    # torchao _auto_filter_for_tensorwise (H100 measurements, torchao/float8 README "tensorwise scaling").
    if k <= 4096 and n <= 1024:
        return (
            f"{n}x{k} is below torchao's tensorwise break-even size (K > 4096 or N > 1024): FP8 would be slower "
            "(precision.skip_small=false converts it anyway)"
        )
    return None


def _not_divisible(n: int, k: int) -> bool:
    """FP8 GEMMs (``torch._scaled_mm``) need both dimensions divisible by 16."""
    return bool(n % 16 or k % 16)


def _is_norm(module: nn.Module, kind: str) -> bool:
    """A LayerNorm, or an RMSNorm (torch's, ours, a Hugging Face ``*RMSNorm``) with one 1-D weight."""
    if isinstance(module, nn.LayerNorm):
        return module.elementwise_affine
    weight = getattr(module, "weight", None)
    return (
        kind.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and len(getattr(weight, "ds_shape", weight.shape)) == 1
        and isinstance(getattr(module, "eps", getattr(module, "variance_epsilon", None)), float)
    )


def plan_layers(
    root: nn.Module,
    keep_fp32: Iterable[str] = (),
    *,
    fp8_recipe: str | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    convert_lm_head: bool = False,
    skip_small: bool = True,
    te_norms: bool = False,
) -> list[LayerDecision]:
    """One :class:`LayerDecision` per linear layer (and per fp32-kept module, and per norm Transformer Engine
    replaces), in module order.

    A module that ``keep_fp32`` names runs in fp32 with all its sub-modules, none of which converts. Then, with an
    FP8 recipe, each ``nn.Linear`` converts unless: ``exclude`` names it, ``include`` is given and does not, it is
    the output projection (:func:`output_projections`) and ``convert_lm_head`` is false, or its shape is unsuitable
    (:func:`shape_skip_reason`). Without an FP8 recipe only the fp32-kept modules are listed.

    Args:
        root: the model (a LightningModule: names are as its ``named_modules`` gives them, wrapper parts removed).
        keep_fp32: class names or module-name globs (:func:`matching_pattern`).
        fp8_recipe: the FP8 recipe, ``None`` for no FP8 conversion.
        include: globs; when given, only the linear layers they name are candidates.
        exclude: globs of linear layers that stay in bf16.
        convert_lm_head: convert the output projection too.
        skip_small: keep layers below the measured break-even size in bf16.
        te_norms: list the norms that Transformer Engine's fused modules replace (``fp8_te``).
    """
    keep, inc, exc = tuple(keep_fp32), tuple(include), tuple(exclude)
    outputs = output_projections(root) if fp8_recipe is not None else set()
    decisions: list[LayerDecision] = []

    def visit(module: nn.Module, raw: str) -> None:
        name, kind = clean_name(raw), own_class_name(module)
        shape = (int(module.out_features), int(module.in_features)) if isinstance(module, nn.Linear) else None
        kept = matching_pattern(name, kind, keep) if raw else None
        if kept is not None:
            decisions.append(
                LayerDecision(name, kind, shape, "fp32", f"precision.keep_fp32 names it ({kept!r})", "keep_fp32")
            )
            return
        if fp8_recipe is not None and isinstance(module, nn.Linear):
            decisions.append(
                _linear_decision(module, name, kind, fp8_recipe, inc, exc, outputs, convert_lm_head, skip_small)
            )
        elif fp8_recipe is not None and te_norms and _is_norm(module, kind):
            decisions.append(
                LayerDecision(
                    name, kind, None, "bf16", "replaced by Transformer Engine's norm (no FP8 GEMM in a norm)", "te_norm"
                )
            )
        for child_name, child in module.named_children():
            visit(child, f"{raw}.{child_name}" if raw else child_name)

    visit(root, "")
    return decisions


def _linear_decision(
    module: nn.Linear,
    name: str,
    kind: str,
    recipe: str,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    outputs: set[int],
    convert_lm_head: bool,
    skip_small: bool,
) -> LayerDecision:
    shape = (module.out_features, module.in_features)
    excluded = matching_pattern(name, kind, exclude)
    if excluded is not None:
        return LayerDecision(name, kind, shape, "bf16", f"precision.exclude names it ({excluded!r})", "excluded")
    if include and matching_pattern(name, kind, include) is None:
        return LayerDecision(name, kind, shape, "bf16", "not named by precision.include", "not_included")
    if id(module) in outputs and not convert_lm_head:
        return LayerDecision(
            name,
            kind,
            shape,
            "bf16",
            "output projection: kept in bf16 (precision.convert_lm_head=true converts it)",
            "output_projection",
        )
    skip = shape_skip_reason(*shape, recipe, skip_small)
    if skip is not None:
        cause = "not_divisible_by_16" if _not_divisible(*shape) else "below_break_even"
        return LayerDecision(name, kind, shape, "bf16", skip, cause)
    return LayerDecision(name, kind, shape, "fp8", f"converted ({recipe} scaling)")
