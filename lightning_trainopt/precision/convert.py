"""Apply a precision preset's model changes: FP8 layers (torchao or Transformer Engine) and fp32-kept modules.

Called once on the built model, before DDP, the DeepSpeed engine or FSDP2 wraps it (torchtitan's order: convert,
then ``fully_shard``). torchao's swap reuses each weight ``Parameter`` (``Float8Linear.from_float``), so parameter
names, tied weights and DeepSpeed ZeRO-3's partitioned placeholders are kept; Transformer Engine's modules are given
the same ``Parameter`` objects too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_trainopt.exceptions import MissingDependencyError
from lightning_trainopt.precision.fp8_spec import FP8PrecisionSpec
from lightning_trainopt.precision.keep_fp32 import keep_in_fp32
from lightning_trainopt.precision.layer_filter import NOT_FP8_CAUSES, LayerDecision, clean_name, plan_layers
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["ConversionReport", "convert_model", "te_recipe", "torchao_config"]

_MARK = "_trainopt_precision_report"


@dataclass
class ConversionReport:
    """What :func:`convert_model` did: the backend and recipe, and each layer's decision with its reason.

    Args:
        backend: ``torchao``, ``transformer_engine``, or ``None`` (only fp32-kept modules).
        recipe: the scaling recipe.
        emulated: torchao's FP8 GEMMs are emulated in fp32 (CPU).
        fsdp_float8_all_gather: FSDP2 all-gathers the converted weights in FP8 (torchao tensorwise under FSDP2).
        layers: one :class:`LayerDecision` per linear layer and per fp32-kept module.
    """

    backend: str | None
    recipe: str | None
    emulated: bool = False
    fsdp_float8_all_gather: bool = False
    layers: list[LayerDecision] = field(default_factory=list)

    def _count(self, action: str) -> int:
        return sum(1 for d in self.layers if d.action == action and (action != "bf16" or d.shape is not None))

    @property
    def fp8_weight_fraction(self) -> float | None:
        """The share of the linear layers' weight elements that run in FP8 (``None`` without linear layers)."""
        sizes = [(d.shape[0] * d.shape[1], d.action == "fp8") for d in self.layers if d.shape is not None]
        total = sum(n for n, _ in sizes)
        return sum(n for n, fp8 in sizes if fp8) / total if total else None

    def not_fp8(self) -> list[dict[str, Any]]:
        """The linear layers an FP8 preset left out, counted by cause: ``[{"cause", "layers", "why", "change"}]``.

        ``change`` is the setting that would convert them (``None`` when none would); ``[]`` without FP8.
        """
        if self.backend is None:
            return []
        counts: dict[str, int] = {}
        for d in self.layers:
            if d.shape is not None and d.action != "fp8" and d.cause:
                counts[d.cause] = counts.get(d.cause, 0) + 1
        return [
            {"cause": cause, "layers": n, "why": NOT_FP8_CAUSES[cause][0], "change": NOT_FP8_CAUSES[cause][1]}
            for cause, n in counts.items()
        ]

    def warning(self) -> str | None:
        """What to tell the user when an FP8 preset converts no linear layer (the run then has no FP8 at all)."""
        if self.backend is None or self._count("fp8"):
            return None
        linear = sum(1 for d in self.layers if d.shape is not None)
        causes = "; ".join(
            f"{e['layers']} {e['why']}" + (f" (change: {e['change']})" if e["change"] else "") for e in self.not_fp8()
        )
        return f"no layer runs in FP8 (0 of {linear} linear layers)" + (f": {causes}" if causes else "")

    def to_dict(self) -> dict[str, Any]:
        """metrics.json's ``precision_layers``: counts, the FP8 share, the layers left out by cause, every decision."""
        return {
            "backend": self.backend,
            "recipe": self.recipe,
            "emulated": self.emulated,
            "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
            "fp8_layers": self._count("fp8"),
            "bf16_layers": self._count("bf16"),
            "fp32_modules": self._count("fp32"),
            "fp8_weight_fraction": self.fp8_weight_fraction,
            "not_fp8": self.not_fp8(),
            "warning": self.warning(),
            "layers": [d.to_dict() for d in self.layers],
        }

    def text(self) -> str:
        """Some lines for the log: the totals, each kept layer with its reason (similar reasons grouped)."""
        head = []
        if self.backend is not None:
            how = f"{self.backend} {self.recipe}" + (", emulated in fp32" if self.emulated else "")
            if self.fsdp_float8_all_gather:
                how += ", FP8 all-gather under FSDP2"
            linear = [d for d in self.layers if d.shape is not None]
            share = self.fp8_weight_fraction
            head.append(
                f"FP8 ({how}): {self._count('fp8')} of {len(linear)} linear layers converted"
                + (f" ({share:.0%} of their weights)" if share is not None else "")
                + "."
            )
        by_reason: dict[tuple[str, str], list[str]] = {}
        for d in self.layers:
            if d.action != "fp8":
                by_reason.setdefault((d.action, d.reason), []).append(d.name)
        for (action, reason), names in by_reason.items():
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            head.append(f"  {action}: {shown}: {reason}")
        return "\n".join(head)


def torchao_config(recipe: str, emulate: bool, fsdp_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for a recipe; FP8 all-gather only where torchao has it (tensorwise)."""
    from torchao.float8 import Float8LinearConfig

    base = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        base, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise"
    )


def te_recipe(recipe: str) -> Any:
    """Transformer Engine's recipe object: ``DelayedScaling`` or ``Float8CurrentScaling``, E4M3 forward and E5M2
    gradients (``Format.HYBRID``, NVIDIA's recommendation for training)."""
    from transformer_engine.common import recipe as te_recipes

    fmt = te_recipes.Format.HYBRID
    if recipe == "delayed":
        return te_recipes.DelayedScaling(fp8_format=fmt)
    return te_recipes.Float8CurrentScaling(fp8_format=fmt)


def _require(package: str, feature: str, extra: str) -> None:
    import importlib

    try:
        importlib.import_module(package)
    except ImportError:
        raise MissingDependencyError(package, extra, feature) from None


def convert_model(root: nn.Module, spec: PrecisionSpec, *, emulate: bool, fsdp: bool) -> ConversionReport:
    """Convert ``root`` in place as ``spec`` says, once; a second call returns the first call's report.

    Args:
        root: the LightningModule (or any module) with its model built.
        spec: the precision preset; :class:`FP8PrecisionSpec` converts linear layers, ``keep_fp32`` of any preset
            keeps modules in fp32.
        emulate: torchao: emulate FP8 GEMMs in fp32 (the caller resolves ``spec.emulate=None`` by device).
        fsdp: FSDP2 will shard the model (torchao tensorwise then all-gathers in FP8).

    Raises:
        MissingDependencyError: the backend's package is not installed.
    """
    done = root.__dict__.get(_MARK)
    if isinstance(done, ConversionReport):
        return done
    fp8 = spec if isinstance(spec, FP8PrecisionSpec) else None
    report = ConversionReport(backend=None, recipe=None)
    if fp8 is not None:
        assert fp8.recipe is not None
        report = ConversionReport(backend=fp8.backend, recipe=fp8.recipe, emulated=emulate and not fp8.is_te)
        report.layers = plan_layers(
            root,
            spec.keep_fp32,
            fp8_recipe=fp8.recipe,
            include=fp8.include,
            exclude=fp8.exclude,
            convert_lm_head=fp8.convert_lm_head,
            skip_small=fp8.skip_small,
            te_norms=fp8.is_te,
        )
        if fp8.is_te:
            _require("transformer_engine", f"precision={spec.name}", "gpu")
            _convert_te(root, report.layers)
        else:
            _require("torchao", f"precision={spec.name}", "torchao")
            report.fsdp_float8_all_gather = fsdp and fp8.recipe == "tensorwise"
            _convert_torchao(root, report.layers, torchao_config(fp8.recipe, emulate, fsdp))
    else:
        report.layers = plan_layers(root, spec.keep_fp32)
    kept = {d.name for d in report.layers if d.action == "fp32"}
    for name, module in _named(root):
        if name in kept:
            keep_in_fp32(module)
    root.__dict__[_MARK] = report
    return report


def _named(root: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(clean_name(name), module) for name, module in root.named_modules() if name]


def _convert_torchao(root: nn.Module, layers: list[LayerDecision], config: Any) -> None:
    from torchao.float8 import convert_to_float8_training

    chosen = {d.name for d in layers if d.action == "fp8"}
    convert_to_float8_training(root, config=config, module_filter_fn=lambda _m, fqn: clean_name(fqn) in chosen)


def _convert_te(root: nn.Module, layers: list[LayerDecision]) -> None:
    """Swap the chosen ``nn.Linear`` for ``te.Linear`` and the listed norms for ``te.RMSNorm``/``te.LayerNorm``,
    each given the original's ``Parameter`` objects (built on the meta device first: nothing is allocated)."""
    import transformer_engine.pytorch as te

    chosen = {d.name: d for d in layers if d.action == "fp8" or (d.shape is None and d.action == "bf16")}
    parents = dict(_named(root))
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = parents[parent_name] if parent_name else root
        old = getattr(parent, attr)
        weight = old.weight
        bias = getattr(old, "bias", None)
        if isinstance(old, nn.Linear):
            new = te.Linear(old.in_features, old.out_features, bias=bias is not None, device="meta")
        elif isinstance(old, nn.LayerNorm):
            new = te.LayerNorm(old.normalized_shape[0], eps=old.eps, device="meta")
        else:
            eps = float(getattr(old, "eps", getattr(old, "variance_epsilon", 1e-5)))
            new = te.RMSNorm(getattr(weight, "ds_shape", weight.shape)[0], eps=eps, device="meta")
        new.weight = weight
        if bias is not None:
            new.bias = bias
        setattr(parent, attr, new)
