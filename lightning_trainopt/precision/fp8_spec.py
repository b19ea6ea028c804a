"""The FP8 precision presets as data: which backend, which scaling recipe, which layers convert."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.precision.spec import PrecisionSpec, _patterns

__all__ = ["BACKENDS", "RECIPES", "FP8PrecisionSpec"]

BACKENDS = ("torchao", "transformer_engine")
#: The scaling recipes of each backend; the first is the default. torchao: ``Float8LinearConfig.from_recipe_name``;
#: Transformer Engine: ``DelayedScaling`` (amax history, the scale of step n from steps < n) or
#: ``Float8CurrentScaling`` (the scale of each tensor from itself, like torchao's tensorwise).
RECIPES: dict[str, tuple[str, ...]] = {
    "torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "transformer_engine": ("delayed", "current"),
}


@dataclass(frozen=True)
class FP8PrecisionSpec(PrecisionSpec):
    """FP8 training on top of bf16 autocast (``conf/precision/fp8.yaml``, ``fp8_te.yaml``).

    The chosen ``nn.Linear`` layers become FP8 layers (torchao's ``Float8Linear``, or Transformer Engine's
    ``te.Linear``/``te.RMSNorm``/``te.LayerNorm``) after the model is built and before DDP, the DeepSpeed engine or
    FSDP2's ``fully_shard`` wraps it; everything else runs under bf16 autocast (``trainer_precision: bf16-mixed``).

    Args:
        name: preset name (``fp8``, ``fp8_te``).
        trainer_precision: must be ``bf16-mixed`` (the precision of everything not converted).
        backend: ``torchao`` or ``transformer_engine``.
        recipe: scaling recipe, one of :data:`RECIPES` of the backend; ``None``: the backend's first.
        include: module-name globs; when given, only matching linear layers are candidates.
        exclude: module-name globs of linear layers to keep in bf16.
        convert_lm_head: also convert the output projection (kept in bf16 by default: its logits feed the loss).
        skip_small: keep layers below torchao's measured break-even size in bf16 (FP8 is slower there); ``False``
            converts every layer whose dimensions are divisible by 16 (tiny test models).
        emulate: torchao only: run the FP8 GEMMs emulated in fp32 (``Float8LinearConfig(emulate=True)``). ``None``:
            emulate on CPU, real FP8 GEMMs on a GPU.
        keep_fp32: as in :class:`PrecisionSpec`; these modules are never converted.
        init_scale: not used by FP8 (bf16 needs no loss scaling); must stay ``None``.
        growth_interval: not used by FP8; must stay ``None``.

    Raises:
        ConfigError: an unknown backend or recipe, a trainer precision other than ``bf16-mixed``, ``emulate`` with
            Transformer Engine, or loss-scaling knobs.

    Example::

        FP8PrecisionSpec(name="fp8", trainer_precision="bf16-mixed", backend="torchao", recipe="rowwise")
    """

    backend: str = "torchao"
    recipe: str | None = None
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    convert_lm_head: bool = False
    skip_small: bool = True
    emulate: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.trainer_precision != "bf16-mixed":
            raise ConfigError(
                "precision.trainer_precision",
                self.trainer_precision,
                "FP8 runs on top of bf16 autocast; use bf16-mixed.",
            )
        if self.init_scale is not None or self.growth_interval is not None:
            raise ConfigError(
                "precision.init_scale" if self.init_scale is not None else "precision.growth_interval",
                self.init_scale if self.init_scale is not None else self.growth_interval,
                "FP8 here runs with bf16 for what is not converted, which needs no loss scaling; remove it.",
            )
        if self.backend not in BACKENDS:
            raise ConfigError("precision.backend", self.backend, f"use one of {', '.join(BACKENDS)}.")
        recipes = RECIPES[self.backend]
        if self.recipe is None:
            object.__setattr__(self, "recipe", recipes[0])
        elif self.recipe not in recipes:
            raise ConfigError("precision.recipe", self.recipe, f"{self.backend} has the recipes {', '.join(recipes)}.")
        object.__setattr__(self, "include", _patterns("precision.include", self.include))
        object.__setattr__(self, "exclude", _patterns("precision.exclude", self.exclude))
        for key in ("convert_lm_head", "skip_small"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"precision.{key}", getattr(self, key), "use true or false.")
        if self.emulate is not None and not isinstance(self.emulate, bool):
            raise ConfigError("precision.emulate", self.emulate, "use true, false, or null (emulate on CPU only).")
        if self.emulate and self.backend != "torchao":
            raise ConfigError(
                "precision.emulate",
                self.emulate,
                "Transformer Engine has no emulation; use precision=fp8 (torchao) to emulate FP8 on CPU.",
            )

    @property
    def transforms_model(self) -> bool:
        return True

    @property
    def is_te(self) -> bool:
        return self.backend == "transformer_engine"
