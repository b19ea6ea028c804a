"""FitReport: train.py's end-of-fit report for your own Trainer: one table of every callback's figures."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from rich.console import Console
from typing_extensions import override

from lightning_trainopt.callbacks._summary_table import callback_summaries, print_summary
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.adapter_accounting import param_count

__all__ = ["FitReport"]


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _n_params(module: pl.LightningModule) -> int:
    """Every parameter's full size, also when a sharding engine holds only a slice of it (ZeRO-3 ``ds_numel``) or
    QLoRA packs it in 4 bits."""
    return sum(param_count(p) for p in module.parameters())


class FitReport(Callback):
    """At the end of ``fit``, print the table ``train.py`` prints: the run's headline figures, then one line per
    callback that reports (StepTimer, SpeedMonitor, MemoryBreakdown, CostMonitor, ...), from rank 0.

    Add it last to a Trainer of your own; it reads the other callbacks' ``summary()`` and
    ``trainer.callback_metrics`` and changes nothing.

    Args:
        path: also write the figures as JSON there (strict JSON: a non-finite figure is ``null``).
        loss_keys: the logged metrics to show as the final train and validation loss.
        console: the rich ``Console`` to print to (default: a new one on stdout).

    Example::

        trainer = Trainer(callbacks=[StepTimer(), SpeedMonitor(), MemoryBreakdown(), CostMonitor(), FitReport()])
    """

    def __init__(
        self,
        path: str | Path | None = None,
        loss_keys: tuple[str, str] = ("train_loss", "val_loss"),
        console: Console | None = None,
    ) -> None:
        if not (isinstance(loss_keys, (tuple, list)) and len(loss_keys) == 2):
            raise ConfigError("loss_keys", loss_keys, "give two metric names, e.g. ('train_loss', 'val_loss').")
        self.path = Path(path) if path is not None else None
        self.loss_keys = tuple(loss_keys)
        self.console = console
        self.figures: dict[str, Any] = {}

    def report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The figures of the fit so far (what the table shows and ``path`` holds)."""
        metrics = trainer.callback_metrics
        train_key, val_key = self.loss_keys
        figures: dict[str, Any] = {
            "status": "stopped" if trainer.should_stop else "ok",
            "model": type(pl_module).__name__,
            "n_params": _n_params(pl_module),
            "strategy": type(trainer.strategy).__name__.removesuffix("Strategy").lower(),
            "precision": str(trainer.precision),
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "train_loss": _scalar(metrics.get(train_key)),
            "val_loss": _scalar(metrics.get(val_key)),
        }
        figures.update(callback_summaries(getattr(trainer, "callbacks", [])))
        return figures

    def summary(self) -> dict[str, Any]:
        """Nothing of its own: the report is made of the other callbacks' summaries."""
        return {}

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.figures = self.report(trainer, pl_module)
        if not trainer.is_global_zero:
            return
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.figures, indent=2, default=str))
        print_summary(self.figures, self.path, console=self.console)
