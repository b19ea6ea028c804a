"""Precision presets and the Trainer arguments built from them."""

from lightning_trainopt.precision.plugins import trainer_precision_kwargs
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["PrecisionSpec", "trainer_precision_kwargs"]
