"""Precision presets and the plugins built from them."""

from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["PrecisionSpec"]
