"""Precision presets, the Trainer arguments built from them, and the model changes they make (FP8, fp32-kept)."""

from lightning_trainopt.precision.convert import ConversionReport, convert_model
from lightning_trainopt.precision.fp8_spec import FP8PrecisionSpec
from lightning_trainopt.precision.keep_fp32 import is_kept_fp32, keep_in_fp32
from lightning_trainopt.precision.layer_filter import LayerDecision, plan_layers
from lightning_trainopt.precision.plugins import PrecisionNeeds, trainer_precision_kwargs
from lightning_trainopt.precision.spec import PrecisionSpec
from lightning_trainopt.precision.transform_plugins import (
    ModelTransforms,
    TransformDeepSpeedPrecision,
    TransformMixedPrecision,
)

__all__ = [
    "ConversionReport",
    "FP8PrecisionSpec",
    "LayerDecision",
    "ModelTransforms",
    "PrecisionNeeds",
    "PrecisionSpec",
    "TransformDeepSpeedPrecision",
    "TransformMixedPrecision",
    "convert_model",
    "is_kept_fp32",
    "keep_in_fp32",
    "plan_layers",
    "trainer_precision_kwargs",
]
