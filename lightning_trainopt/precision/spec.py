"""Precision presets as data: what the Trainer is asked for, and fp16 loss-scaling knobs."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_trainopt.exceptions import ConfigError

__all__ = ["PrecisionSpec"]

_TRAINER_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "transformer-engine")


@dataclass(frozen=True)
class PrecisionSpec:
    """One precision preset (``conf/precision/*.yaml``).

    Args:
        name: preset name (``fp32``, ``bf16``, ``fp16``, ``bf16_true``, ...).
        trainer_precision: the value handed to Lightning's ``Trainer(precision=...)``.
        init_scale: fp16 only: initial dynamic loss scale (``GradScaler(init_scale=...)``; DeepSpeed
            ``initial_scale_power = log2(init_scale)``).
        growth_interval: fp16 only: steps without overflow before the scale doubles (DeepSpeed ``loss_scale_window``).

    Example::

        PrecisionSpec(name="fp16", trainer_precision="16-mixed", init_scale=65536.0, growth_interval=2000)
    """

    name: str
    trainer_precision: str
    init_scale: float | None = None
    growth_interval: int | None = None

    def __post_init__(self) -> None:
        if self.trainer_precision not in _TRAINER_PRECISIONS:
            raise ConfigError(
                "precision.trainer_precision", self.trainer_precision, f"use one of {', '.join(_TRAINER_PRECISIONS)}."
            )
        if self.init_scale is not None and not self.init_scale > 0:
            raise ConfigError("precision.init_scale", self.init_scale, "use a positive loss scale, e.g. 65536.")
        if self.growth_interval is not None and (not isinstance(self.growth_interval, int) or self.growth_interval < 1):
            raise ConfigError("precision.growth_interval", self.growth_interval, "use a positive integer, e.g. 2000.")

    @property
    def is_fp16(self) -> bool:
        return self.trainer_precision.startswith("16")

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype (2 for fp16/bf16, 4 for fp32)."""
        return 4 if self.trainer_precision == "32-true" else 2
