"""Turn a :class:`PrecisionSpec` into the ``Trainer`` arguments for a given strategy."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["trainer_precision_kwargs"]


def trainer_precision_kwargs(spec: PrecisionSpec, strategy: Strategy | str) -> dict[str, Any]:
    """``{"precision": ...}`` or, for fp16 with custom loss scaling outside DeepSpeed, ``{"plugins": [...]}``.

    DeepSpeed runs its own loss scaler (configured by the strategy builder from the same knobs), so it only
    needs the precision string.
    """
    custom_scaler = spec.init_scale is not None or spec.growth_interval is not None
    if spec.trainer_precision != "16-mixed" or not custom_scaler or isinstance(strategy, DeepSpeedStrategy):
        return {"precision": spec.trainer_precision}
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler_kwargs: dict[str, Any] = {}
    if spec.init_scale is not None:
        scaler_kwargs["init_scale"] = spec.init_scale
    if spec.growth_interval is not None:
        scaler_kwargs["growth_interval"] = spec.growth_interval
    scaler = torch.amp.GradScaler("cuda", **scaler_kwargs)
    return {"plugins": [MixedPrecision("16-mixed", "cuda", scaler=scaler)]}
