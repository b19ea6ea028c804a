"""Keep a run's console to what its user needs: no third-party chatter they cannot act on, no empty figures."""

from __future__ import annotations

import logging
import os
import warnings

from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import TrainDescriptionProgressBar

__all__ = ["StepsProgressBar", "model_line", "quiet_console"]

# (category, message regex): deprecations raised inside DeepSpeed's and Lightning's own calls into torch, printed by
# every rank at every DeepSpeed run (about 20 lines); nothing in the user's code or config can change them.
_THIRD_PARTY_DEPRECATIONS = (
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)


class _DropTips(logging.Filter):
    """Lightning's advertisement for its hosted logger, printed at every Trainer construction."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_console(on_cpu: bool) -> None:
    """Silence what a run prints that is neither a figure nor something the user can act on. Idempotent.

    * DeepSpeed, imported on a CPU-only run, warns that it found no GPU: tell it the accelerator (``DS_ACCELERATOR``,
      only when unset and the run is on CPU, so a GPU machine that fails detection still says so).
    * The C compiler probes DeepSpeed runs to test for libaio log two ``gcc`` lines per rank at INFO.
    * The deprecations in ``_THIRD_PARTY_DEPRECATIONS`` and Lightning's hosted-logger tip.

    Args:
        on_cpu: the run's ranks are CPU processes.
    """
    if on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("compilers").setLevel(logging.WARNING)
    for category, message in _THIRD_PARTY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropTips) for f in rank_zero.filters):
        rank_zero.addFilter(_DropTips())


def model_line(name: str, n_params: int, trainable: int | None = None, adapter: str | None = None) -> str:
    """The one line train.py prints about the model instead of Lightning's summary table.

    Lightning's table counts FLOPs only for a module with an ``example_input_array`` and otherwise prints a FLOPs
    column of zeros and ``Total FLOPs: 0``; the run's real FLOPs are SpeedMonitor's (metrics.json ``throughput``).
    With an adapter (``adapter``: its kind) the line is printed before the adapters exist (they are injected when the
    strategy builds the model), so it gives the base's count and points to metrics.json's ``trainable_params``.
    """
    if adapter is not None:
        return (
            f"model {name}: {n_params:,} parameters in the base, frozen; adapter={adapter} trains only its adapters "
            "(metrics.json trainable_params); FLOPs: SpeedMonitor's figures."
        )
    trainable = n_params if trainable is None else trainable
    frozen = f", {n_params - trainable:,} frozen" if trainable != n_params else ""
    return f"model {name}: {n_params:,} parameters ({trainable:,} trainable{frozen}); FLOPs: SpeedMonitor's figures."


class StepsProgressBar(TrainDescriptionProgressBar):
    """Lightning's rich progress bar, without ``Epoch 0/-2`` on a run that is bounded by ``max_steps``.

    A Trainer given ``max_steps`` has ``max_epochs=-1`` (no bound), which the parent prints as ``/{max_epochs - 1}``.
    """

    @override
    def describe_train_epoch(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        description = f"Epoch {current_epoch}"
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"
        return description
