"""Turn a :class:`PrecisionSpec` into the ``Trainer`` arguments for a given strategy."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy

from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["FP16_FSDP2_FIX", "FP16_FSDP2_REASON", "trainer_precision_kwargs"]

FP16_FSDP2_REASON = (
    "Lightning's ModelParallelStrategy (FSDP2) supports 32-true, bf16-mixed, bf16-true and 16-true only: fp16 AMP "
    "needs a loss scaler that agrees across ranks on skipping a step, and a plain GradScaler checks only the local "
    "gradient shards, so ranks would skip different steps and their shards would drift apart."
)
FP16_FSDP2_FIX = "use precision=bf16 with +strategy=fsdp, or fp16 with a DeepSpeed preset (its loss scaler is global)."


def _device(accelerator: str | None) -> str:
    """Where autocast applies: ``cpu`` for a CPU accelerator, else ``cuda`` when a GPU is visible."""
    if accelerator == "cpu":
        return "cpu"
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_precision_kwargs(
    spec: PrecisionSpec, strategy: Strategy | str, accelerator: str | None = None
) -> dict[str, Any]:
    """``{"precision": ...}`` or, for fp16 with custom loss scaling outside DeepSpeed, ``{"plugins": [...]}``.

    A preset that changes the model (FP8 layers, ``keep_fp32``) gets our plugin of the strategy's kind
    (:mod:`~lightning_trainopt.precision.transform_plugins`): ``TransformDeepSpeedPrecision`` under DeepSpeed,
    ``TransformMixedPrecision`` otherwise (told when the strategy is FSDP2, for torchao's FP8 all-gather).

    DeepSpeed runs its own loss scaler (configured by the strategy builder from the same knobs), so it only needs
    the precision string. FSDP1 gets ``FSDPPrecision`` with a ``ShardedGradScaler`` (the one that all-reduces the
    inf check across ranks), any other strategy a ``MixedPrecision`` with a ``GradScaler``.

    Raises:
        IncompatibleConfigError: fp16 AMP with FSDP2 (``ModelParallelStrategy``), which Lightning itself refuses for
            the precision string; passing a plugin would slip past that check.

    Args:
        spec: the precision preset.
        strategy: the strategy (or ``"auto"``).
        accelerator: ``trainer.accelerator`` (``cpu``, ``gpu``, ``auto``...): where autocast and FP8 run; ``None``
            or ``auto``: a visible GPU, else the CPU.
    """
    if spec.trainer_precision == "16-mixed" and isinstance(strategy, ModelParallelStrategy):
        raise IncompatibleConfigError(
            {"precision": spec.name, "strategy": type(strategy).__name__}, FP16_FSDP2_REASON, FP16_FSDP2_FIX
        )
    custom_scaler = spec.init_scale is not None or spec.growth_interval is not None
    if spec.transforms_model:
        return {"plugins": [_transform_plugin(spec, strategy, _device(accelerator), custom_scaler)]}
    if spec.trainer_precision != "16-mixed" or not custom_scaler or isinstance(strategy, DeepSpeedStrategy):
        return {"precision": spec.trainer_precision}
    scaler_kwargs = _scaler_kwargs(spec)
    if isinstance(strategy, FSDPStrategy):
        from lightning.pytorch.plugins.precision import FSDPPrecision
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # FSDPPrecision("16-mixed", scaler=...) raises in Lightning 2.6: its check reads self.precision before
        # setting it (still the class default "32-true"), so the scaler is swapped in after construction.
        plugin = FSDPPrecision("16-mixed")
        plugin.scaler = ShardedGradScaler("cuda", **scaler_kwargs)
        return {"plugins": [plugin]}
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cuda", **scaler_kwargs)
    return {"plugins": [MixedPrecision("16-mixed", "cuda", scaler=scaler)]}


def _transform_plugin(spec: PrecisionSpec, strategy: Strategy | str, device: str, custom_scaler: bool) -> Any:
    from lightning_trainopt.precision.transform_plugins import TransformDeepSpeedPrecision, TransformMixedPrecision

    if isinstance(strategy, DeepSpeedStrategy):
        return TransformDeepSpeedPrecision(spec, device)
    scaler = None
    if spec.trainer_precision == "16-mixed":
        scaler = torch.amp.GradScaler("cuda", **(_scaler_kwargs(spec) if custom_scaler else {}))
    return TransformMixedPrecision(spec, device, scaler=scaler, fsdp=isinstance(strategy, ModelParallelStrategy))


def _scaler_kwargs(spec: PrecisionSpec) -> dict[str, Any]:
    """``GradScaler`` arguments from the preset's fp16 knobs (only those it sets)."""
    kwargs: dict[str, Any] = {}
    if spec.init_scale is not None:
        kwargs["init_scale"] = spec.init_scale
    if spec.growth_interval is not None:
        kwargs["growth_interval"] = spec.growth_interval
    return kwargs
