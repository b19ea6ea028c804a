"""Turn a :class:`PrecisionSpec` into the ``Trainer`` arguments for what a strategy needs of its precision plugin.

What the strategy needs (:class:`PrecisionNeeds`) is answered in ``parallel/`` (``StrategySpec.precision_needs``,
``lightning_trainopt.parallel.precision_needs(strategy)``) and handed down as plain values: this room never tests
the class of a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.planner.strategy_layout import registered_answers
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["FP16_FSDP2_FIX", "FP16_FSDP2_REASON", "PrecisionNeeds", "trainer_precision_kwargs"]

FP16_FSDP2_REASON = (
    "Lightning's ModelParallelStrategy (FSDP2) supports 32-true, bf16-mixed, bf16-true and 16-true only: fp16 AMP "
    "needs a loss scaler that agrees across ranks on skipping a step, and a plain GradScaler checks only the local "
    "gradient shards, so ranks would skip different steps and their shards would drift apart."
)
FP16_FSDP2_FIX = "use precision=bf16 with +strategy=fsdp, or fp16 with a DeepSpeed preset (its loss scaler is global)."


@dataclass(frozen=True)
class PrecisionNeeds:
    """What a strategy needs of its precision plugin, as plain answers (``parallel/`` works them out).

    The default (every answer ``False``) is a strategy that wraps the model in nothing of its own: one device, DDP,
    or Lightning's choice (``"auto"``).

    Args:
        strategy: what messages call the strategy (its preset or class name).
        engine_precision: an engine (DeepSpeed) casts the model and scales the loss itself: the Trainer gets only
            the precision string, and a model-changing preset gets the DeepSpeed flavour of our plugin.
        sharded_scaler: the strategy shards gradients with FSDP1's flat units: fp16 loss scaling needs
            ``FSDPPrecision`` with a ``ShardedGradScaler`` (its inf check is all-reduced across ranks).
        per_param_shards: FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``): fp16 AMP is refused, and
            torchao's FP8 weights are all-gathered in FP8.

    Example::

        trainer_precision_kwargs(spec, precision_needs(strategy), "gpu")  # precision_needs from parallel/
    """

    strategy: str = "auto"
    engine_precision: bool = False
    sharded_scaler: bool = False
    per_param_shards: bool = False


def _device(accelerator: str | None) -> str:
    """Where autocast applies: ``cpu`` for a CPU accelerator, else ``cuda`` when a GPU is visible."""
    if accelerator == "cpu":
        return "cpu"
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_precision_kwargs(
    spec: PrecisionSpec, needs: PrecisionNeeds | Any = None, accelerator: str | None = None
) -> dict[str, Any]:
    """``{"precision": ...}`` or, for fp16 with custom loss scaling outside DeepSpeed, ``{"plugins": [...]}``.

    A preset that changes the model (FP8 layers, ``keep_fp32``) gets our plugin of the strategy's needs
    (:mod:`~lightning_trainopt.precision.transform_plugins`): ``TransformDeepSpeedPrecision`` for an engine,
    ``TransformMixedPrecision`` otherwise (told when the strategy is FSDP2, for torchao's FP8 all-gather).

    DeepSpeed runs its own loss scaler (configured by the strategy builder from the same knobs), so it only needs
    the precision string. FSDP1 gets ``FSDPPrecision`` with a ``ShardedGradScaler`` (the one that all-reduces the
    inf check across ranks), any other strategy a ``MixedPrecision`` with a ``GradScaler``.

    Raises:
        IncompatibleConfigError: fp16 AMP with FSDP2 (``ModelParallelStrategy``), which Lightning itself refuses for
            the precision string; passing a plugin would slip past that check.
        TypeError: ``needs`` is neither answers, a strategy ``parallel/`` can answer, nor a strategy's name.

    Args:
        spec: the precision preset.
        needs: what the strategy needs of its plugin (``lightning_trainopt.parallel.precision_needs(strategy)``);
            a built strategy or its name (the earlier form: answered by ``parallel/``); ``None``: a strategy that
            needs nothing of its own (one device, DDP, ``"auto"``).
        accelerator: ``trainer.accelerator`` (``cpu``, ``gpu``, ``auto``...): where autocast and FP8 run; ``None``
            or ``auto``: a visible GPU, else the CPU.
    """
    if needs is None:
        needs = PrecisionNeeds()
    elif isinstance(needs, str):
        needs = PrecisionNeeds(strategy=needs)  # a name Lightning resolves to one device or DDP
    elif not isinstance(needs, PrecisionNeeds):
        # A built strategy, as this function took before its answers moved to parallel/: asked of the answerer
        # parallel/ registers when the package is imported (its spec_of), so callers of the old form keep working.
        answered = getattr(registered_answers(needs), "precision_needs", None)
        if not isinstance(answered, PrecisionNeeds):
            raise TypeError(
                f"trainer_precision_kwargs takes what the strategy needs, not {type(needs).__name__}: pass "
                "lightning_trainopt.parallel.precision_needs(strategy)."
            )
        needs = answered
    if spec.trainer_precision == "16-mixed" and needs.per_param_shards:
        raise IncompatibleConfigError(
            {"precision": spec.name, "strategy": needs.strategy}, FP16_FSDP2_REASON, FP16_FSDP2_FIX
        )
    custom_scaler = spec.init_scale is not None or spec.growth_interval is not None
    if spec.transforms_model:
        return {"plugins": [_transform_plugin(spec, needs, _device(accelerator), custom_scaler)]}
    if spec.trainer_precision != "16-mixed" or not custom_scaler or needs.engine_precision:
        return {"precision": spec.trainer_precision}
    scaler_kwargs = _scaler_kwargs(spec)
    if needs.sharded_scaler:
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


def _transform_plugin(spec: PrecisionSpec, needs: PrecisionNeeds, device: str, custom_scaler: bool) -> Any:
    from lightning_trainopt.precision.transform_plugins import TransformDeepSpeedPrecision, TransformMixedPrecision

    if needs.engine_precision:
        return TransformDeepSpeedPrecision(spec, device)
    scaler = None
    if spec.trainer_precision == "16-mixed":
        scaler = torch.amp.GradScaler("cuda", **(_scaler_kwargs(spec) if custom_scaler else {}))
    return TransformMixedPrecision(spec, device, scaler=scaler, fsdp=needs.per_param_shards)


def _scaler_kwargs(spec: PrecisionSpec) -> dict[str, Any]:
    """``GradScaler`` arguments from the preset's fp16 knobs (only those it sets)."""
    kwargs: dict[str, Any] = {}
    if spec.init_scale is not None:
        kwargs["init_scale"] = spec.init_scale
    if spec.growth_interval is not None:
        kwargs["growth_interval"] = spec.growth_interval
    return kwargs
