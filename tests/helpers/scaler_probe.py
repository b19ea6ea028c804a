"""A callback that records the precision plugin's loss-scaler settings at the start of training."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

SEEN: dict[str, Any] = {}


class ScalerProbe(pl.Callback):
    """Writes ``{"plugin", "init_scale", "growth_interval", "enabled"}`` of the Trainer's scaler into :data:`SEEN`."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        SEEN.clear()
        SEEN["plugin"] = type(plugin).__name__
        if scaler is not None and scaler.is_enabled():
            SEEN.update(init_scale=scaler._init_scale, growth_interval=scaler._growth_interval, enabled=True)
        else:
            SEEN["enabled"] = False
