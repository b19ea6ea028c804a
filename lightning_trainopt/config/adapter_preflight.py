"""Pre-flight of the ``adapter`` group: refused combinations and target names checked before any process starts."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.transforms.adapters import AdapterSpec, check_targets

__all__ = ["QLORA_PRECISIONS", "check_adapter"]

#: Trainer precisions QLoRA's 4-bit base works under: the packed weight is stored as bf16, which a bf16-true cast
#: leaves as it is and the mixed/fp32 precisions never cast.
QLORA_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def check_adapter(cfg: DictConfig, adapter: AdapterSpec, precision: dict[str, Any]) -> None:
    """Refuse an adapter combination that cannot work, and target names the model does not have.

    Args:
        cfg: the composed ``train.py``/``plan.py`` config (its ``model`` is built on the meta device to check the
            target names, only when an adapter is on).
        adapter: the ``adapter`` group read into its spec.
        precision: the ``precision`` node as plain values.

    Raises:
        IncompatibleConfigError: ``adapter=qlora`` with FP8 or with a precision that casts its base to fp16.
        ConfigError: a target name that matches no linear layer, or an architecture without default targets.
    """
    if not adapter.enabled:
        return
    preset = precision.get("name")
    trainer_precision = str(precision.get("trainer_precision", "32-true"))
    if adapter.kind == "qlora" and precision.get("backend") is not None:
        raise IncompatibleConfigError(
            {"adapter": "qlora", "precision": preset},
            "QLoRA's base layers are bitsandbytes Linear4bit modules holding packed 4-bit weights; FP8 conversion "
            "swaps nn.Linear layers for float8 ones and has no form for a 4-bit weight, and the trainable adapters "
            "are too small for FP8 GEMMs to pay.",
            "use adapter=qlora with precision=bf16 (or bf16_true), or adapter=lora with precision=fp8.",
        )
    if adapter.kind == "qlora" and trainer_precision not in QLORA_PRECISIONS:
        raise IncompatibleConfigError(
            {"adapter": "qlora", "precision": preset},
            f"QLoRA stores its 4-bit base packed in {adapter.quant_storage} and dequantizes it to "
            f"{adapter.compute_dtype}; {trainer_precision} would cast the packed bytes to another dtype (16-true) or "
            "run the adapters under fp16 autocast against a bf16 base.",
            "use precision=bf16 (bf16-mixed), bf16_true or fp32 with adapter=qlora.",
        )
    if cfg.get("model") is not None:
        from lightning_trainopt.config.model_factory import meta_module

        check_targets(meta_module(cfg), adapter)
