"""The :class:`~lightning_trainopt.planner.adapters.AdapterPlan` of any module, read from its linear layers (built on
the meta device, so a 70B model costs no memory), by the names peft matches."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.adapters import AdapterPlan

__all__ = ["matches_target", "module_adapter_plan", "output_head_names"]


def matches_target(name: str, targets: Sequence[str]) -> bool:
    """Whether module ``name`` is targeted: peft's rule for a list of names (the full name, or its last parts)."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def output_head_names(module: nn.Module) -> set[str]:
    """Qualified names of the output head(s): what bitsandbytes' conversion leaves unquantized (transformers'
    ``get_keys_to_not_convert`` keeps the output embeddings), ``lm_head`` by name for other models."""
    outs = set()
    for sub in module.modules():
        get = getattr(sub, "get_output_embeddings", None)
        out = get() if callable(get) else None
        if isinstance(out, nn.Module):
            outs.add(id(out))
    return {name for name, sub in module.named_modules() if id(sub) in outs or name.split(".")[-1] == "lm_head"}


def _features(sub: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a layer peft adapts as linear: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2), whose
    weight is stored ``(in, out)``; ``None`` for any other module."""
    if isinstance(sub, nn.Linear):
        return sub.in_features, sub.out_features
    weight = getattr(sub, "weight", None)
    if type(sub).__name__ == "Conv1D" and isinstance(weight, nn.Parameter) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def module_adapter_plan(
    module: nn.Module,
    kind: str,
    r: int,
    target_modules: Sequence[str],
    dropout: float = 0.0,
    double_quant: bool = True,
    quant_storage_bytes: int = 2,
    blocksize: int = 64,
) -> AdapterPlan:
    """The adapter plan of ``module`` (before the adapter is applied): adapters on the linear layers named by
    ``target_modules`` (the output head only when named: no default target does); under ``qlora`` those layers in
    NF4 (the adapter core quantizes the targeted layers); every other parameter frozen in its own precision. Tied
    parameters count once.

    Raises:
        ConfigError: no linear layer matches ``target_modules``.
    """
    targeted: list[tuple[int, int]] = []
    quantized: list[int] = []
    linear_numel = 0
    in_linear: set[int] = set()
    quantized_ids: set[int] = set()
    for name, sub in module.named_modules():
        features = _features(sub)
        if features is None:
            continue
        # The output head too when it is named: the adapter core adapts (and under QLoRA quantizes) whatever the
        # targets match; the defaults never name it.
        hit = matches_target(name, target_modules)
        if hit:
            targeted.append(features)
        if id(sub.weight) in in_linear:
            continue
        in_linear.add(id(sub.weight))
        linear_numel += sub.weight.numel()
        if kind == "qlora" and hit:
            quantized.append(sub.weight.numel())
            quantized_ids.add(id(sub.weight))
    if not targeted:
        raise ConfigError(
            "adapter.target_modules",
            list(target_modules),
            f"no linear layer of {type(module).__name__} has one of these names; name its layers as peft does "
            "(e.g. [q_proj, v_proj]).",
        )
    frozen = tuple(p.numel() for p in module.parameters() if id(p) not in quantized_ids)
    return AdapterPlan(
        kind,
        r,
        tuple(targeted),
        tuple(quantized),
        frozen,
        frozen_linear_numel=linear_numel,
        dropout=dropout,
        blocksize=blocksize,
        double_quant=double_quant,
        quant_storage_bytes=quant_storage_bytes,
    )
