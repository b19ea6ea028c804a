"""Activations saved for backward kept in pinned CPU memory between forward and backward."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.metrics.saved_tensors import SavedTensorsTransform, transform_saved_tensors
from lightning_trainopt.transforms.offload import CpuOffloader

__all__ = ["ActivationOffload"]

_TRANSFORM_CALLBACKS = ("ActivationOffload", "ActivationCompression")
# The Hydra node of conf/activations/offload.yaml: activations.activation_offload.<argument>.
KEY_PREFIX = "activations.activation_offload"


class _SavedTensorsTransformCallback(Callback):
    """Installs a saved-tensors transform around each training batch's forward and backward."""

    name = "transform"

    def __init__(self) -> None:
        self.enabled = True
        self._ctx: AbstractContextManager[Any] | None = None
        self._report_only = False

    def report_only(self) -> None:
        """Install nothing: the model rewrite runs the training step under :attr:`transform` (``train.py``,
        :func:`~lightning_trainopt.parallel.apply.with_saved_tensors`); :meth:`summary` reads its counters."""
        self._report_only = True

    def make_transform(self) -> SavedTensorsTransform:
        raise NotImplementedError

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        present = [
            type(cb).__name__ for cb in getattr(trainer, "callbacks", []) if type(cb).__name__ in _TRANSFORM_CALLBACKS
        ]
        if len(present) > 1:
            raise IncompatibleConfigError(
                {"callbacks": present},
                "both change how saved activations are stored and only one saved-tensors hook applies at a time.",
                "use one of activations=offload or activations=int8.",
            )
        if not self._report_only:  # report-only: the rewrite holds this transform object; keep its counters
            self.transform = self.make_transform()

    def _exit(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.enabled or self._report_only:
            return
        self._exit()
        self._ctx = transform_saved_tensors(self.transform)
        self._ctx.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._exit()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._exit()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._exit()


class ActivationOffload(_SavedTensorsTransformCallback):
    """Move accelerator activations saved for backward to (pinned) CPU memory, and back for backward.

    On a CPU-only run activations already live in CPU memory: the callback warns once and switches itself off.
    Under the project's :class:`~lightning_trainopt.metrics.saved_tensors.SavedTensorsCounter` the offloaded bytes show
    as ``by_device["cpu"]`` rather than ``cuda``.

    Args:
        pin_memory: page-locked host buffers, so the copies run asynchronously.
        min_numel: smallest storage worth moving (elements).

    Raises:
        ConfigError: ``min_numel`` is not a positive integer.
        IncompatibleConfigError: used together with :class:`ActivationCompression`.

    Example::

        trainer = Trainer(accelerator="gpu", callbacks=[ActivationOffload()])
    """

    name = "activation_offload"

    def __init__(self, pin_memory: bool = True, min_numel: int = 1024) -> None:
        super().__init__()
        self.pin_memory = pin_memory
        self.min_numel = min_numel
        self.transform: CpuOffloader = self.make_transform()  # validates the arguments now

    def make_transform(self) -> CpuOffloader:
        return CpuOffloader(pin_memory=self.pin_memory, min_numel=self.min_numel, key_prefix=KEY_PREFIX)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.enabled = pl_module.device.type != "cpu"
        if not self.enabled:
            rank_zero_warn(
                "ActivationOffload is off: the model runs on the CPU, so its activations already live in CPU memory "
                "and offloading them has no effect.",
                category=UserWarning,
            )

    def summary(self) -> dict[str, Any]:
        """``{"activation_offload": {enabled, offloaded_tensors, shared_tensors, offloaded_bytes}}`` (totals)."""
        return {
            "activation_offload": {
                "enabled": self.enabled,
                "offloaded_tensors": self.transform.n_offloaded,
                "shared_tensors": self.transform.n_shared,
                "offloaded_bytes": self.transform.bytes_offloaded,
            }
        }
