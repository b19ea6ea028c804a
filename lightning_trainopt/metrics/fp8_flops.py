"""The share of a training step's FLOPs that runs in FP8: the converted linear layers found in the model.

A converted layer is torchao's ``Float8Linear`` or Transformer Engine's ``Linear`` (the classes ``precision.convert``
swaps in). Each runs once per token per forward in a transformer: ``2 x out x in`` FLOPs forward, twice that in
backward, the same convention as :mod:`lightning_trainopt.metrics.flops`.
"""

from __future__ import annotations

from torch import nn

__all__ = ["fp8_flops_per_token", "fp8_flops_share", "fp8_linear_shapes"]


def _is_fp8_linear(module: nn.Module) -> bool:
    cls = type(module)
    for klass in cls.__mro__:
        if klass.__name__ == "Float8Linear" and klass.__module__.startswith("torchao."):
            return True
        if klass.__name__ == "Linear" and klass.__module__.startswith("transformer_engine."):
            return True
    return False


def fp8_linear_shapes(module: nn.Module) -> tuple[tuple[int, int], ...]:
    """``(out_features, in_features)`` of each FP8 linear layer of ``module`` (each module once)."""
    shapes = []
    for m in module.modules():
        n, k = getattr(m, "out_features", None), getattr(m, "in_features", None)
        if _is_fp8_linear(m) and isinstance(n, int) and isinstance(k, int):
            shapes.append((n, k))
    return tuple(shapes)


def fp8_flops_per_token(shapes: tuple[tuple[int, int], ...]) -> int:
    """Training FLOPs per token (forward + backward) of linear layers of these shapes: ``6 x out x in`` each."""
    return 6 * sum(n * k for n, k in shapes)


def fp8_flops_share(shapes: tuple[tuple[int, int], ...], tokens: int, model_flops: int) -> float | None:
    """The FP8 layers' share of ``model_flops`` (a micro-batch's training FLOPs) over ``tokens`` tokens.

    ``None`` when the model FLOPs are unknown (not positive); at most 1.
    """
    if model_flops <= 0:
        return None
    return min(1.0, fp8_flops_per_token(shapes) * tokens / model_flops)
