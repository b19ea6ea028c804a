"""Callback that puts what the precision preset did to the model (FP8 layers, fp32-kept modules) in the summary."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_trainopt.precision import ModelTransforms

__all__ = ["PrecisionReport"]


class PrecisionReport(Callback):
    """Reads the conversion report of our precision plugin once the strategy has set the model up.

    ``summary()`` returns ``{"precision_layers": {"backend", "recipe", "emulated", "fsdp_float8_all_gather",
    "fp8_layers", "bf16_layers", "fp32_modules", "fp8_weight_fraction", "not_fp8": [{"cause", "layers", "why",
    "change"}, ...], "warning", "layers": [{"name", "kind", "shape", "action", "reason", "cause"}, ...]}}``
    (metrics.json), or nothing when the precision preset changes no layer (plain bf16, fp32, fp16). ``warning`` says
    so when an FP8 preset converted no layer. The plugin itself logs the same on rank 0 when it converts.

    Example::

        plugins = trainer_precision_kwargs(spec, precision_needs(strategy))["plugins"]
        Trainer(strategy=strategy, plugins=plugins, callbacks=[PrecisionReport()])
    """

    def __init__(self) -> None:
        self.report: dict[str, Any] | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.strategy.precision_plugin
        if isinstance(plugin, ModelTransforms) and plugin.report is not None:
            self.report = plugin.report.to_dict()

    def summary(self) -> dict[str, Any]:
        """``{"precision_layers": ...}`` when the model was converted, else ``{}``."""
        return {} if self.report is None else {"precision_layers": self.report}
