"""Precision presets as data: what the Trainer is asked for, and fp16 loss-scaling knobs."""

from __future__ import annotations

from collections.abc import Sequence
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
        keep_fp32: modules that run in fp32 with autocast off (the design's "SafeLayer"): class names
            (``RMSNorm``) or module-name globs (``lm_head``, ``"*.router"``); a glob matches the whole name or its
            end at a ``.`` boundary. Only under a mixed precision (``*-mixed``, FP8); empty: none.

    Example::

        PrecisionSpec(name="fp16", trainer_precision="16-mixed", init_scale=65536.0, growth_interval=2000)
        PrecisionSpec(name="bf16", trainer_precision="bf16-mixed", keep_fp32=["RMSNorm", "lm_head"])
    """

    name: str
    trainer_precision: str
    init_scale: float | None = None
    growth_interval: int | None = None
    keep_fp32: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.trainer_precision not in _TRAINER_PRECISIONS:
            raise ConfigError(
                "precision.trainer_precision", self.trainer_precision, f"use one of {', '.join(_TRAINER_PRECISIONS)}."
            )
        if self.init_scale is not None and not self.init_scale > 0:
            raise ConfigError("precision.init_scale", self.init_scale, "use a positive loss scale, e.g. 65536.")
        if self.growth_interval is not None and (not isinstance(self.growth_interval, int) or self.growth_interval < 1):
            raise ConfigError("precision.growth_interval", self.growth_interval, "use a positive integer, e.g. 2000.")
        object.__setattr__(self, "keep_fp32", _patterns("precision.keep_fp32", self.keep_fp32))
        if self.keep_fp32 and self.trainer_precision.endswith("-true") and self.trainer_precision != "32-true":
            raise ConfigError(
                "precision.keep_fp32",
                list(self.keep_fp32),
                f"{self.trainer_precision} keeps every parameter in half precision and has no autocast to turn off; "
                "use a mixed preset (precision=bf16, fp16, fp8) with keep_fp32.",
            )

    @property
    def transforms_model(self) -> bool:
        """The model is changed before the strategy wraps it (FP8 layers, fp32-kept modules): needs our plugin."""
        return bool(self.keep_fp32) and self.trainer_precision != "32-true"

    @property
    def is_fp16(self) -> bool:
        return self.trainer_precision.startswith("16")

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype (2 for fp16/bf16, 4 for fp32)."""
        return 4 if self.trainer_precision == "32-true" else 2


def _patterns(key: str, value: object) -> tuple[str, ...]:
    """A list of non-empty strings (class names or globs) as a tuple; a bare string is refused, not split."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(key, value, 'give a list of class names or module-name globs, e.g. [RMSNorm, "*.router"].')
    return tuple(value)
