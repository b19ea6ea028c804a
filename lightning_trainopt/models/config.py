"""Shape of the LLaMA-style demo transformer: the plain data lives in ``core`` (which imports no model code)."""

from lightning_trainopt.metrics.model_shape import GPTConfig

__all__ = ["GPTConfig"]
