"""Every private attribute of Lightning (``lightning.pytorch``, ``lightning.fabric``) that the package touches.

Written against lightning >=2.4,<2.7 (:data:`LIGHTNING_RANGE`); ``tests/unit/compat/test_lightning_internals.py``
fails naming the change when an upgrade renames or reshapes one of them.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any, TypeAlias

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer

from lightning_trainopt._compat._guard import changed, private_attr

__all__ = [
    "LIGHTNING_RANGE",
    "DeepSpeedStrategyHooks",
    "TrainDescriptionProgressBar",
    "PathLike",
    "checkpoint_every_n_train_steps",
    "fetch_hooks",
    "module_trainer",
    "set_fetch_hooks",
    "restore_fetch_hooks",
    "save_last_checkpoint",
    "set_device_mesh",
    "set_model_parallel_sizes",
    "set_received_sigterm",
    "shard_fully_when_auto",
    "take_observed_children",
]

#: The lightning versions these wrappers were written and tested against: ``[low, high)``.
LIGHTNING_RANGE = ("2.4", "2.7")
_MODULE = "lightning_internals"

#: The path type of Lightning's checkpoint signatures, spelled as ``lightning.fabric.utilities.types._PATH`` is
#: (``Union[str, Path]``), so overrides type-check without importing the private alias.
PathLike: TypeAlias = str | Path


def _changed(what: str) -> Exception:
    return changed("lightning", what, *LIGHTNING_RANGE, _MODULE)


def take_observed_children() -> list[subprocess.Popen]:
    """Take the child processes Lightning's launcher watches away from its observer threads, and return them.

    Lightning's ``_SubprocessScriptLauncher`` starts a ``_ChildProcessObserver`` thread that SIGKILLs the launching
    process as soon as a child exits non-zero; a sweep that wants to outlive a failed job takes its children back.
    Each observer re-reads its list every few seconds and counts an empty one as every child having exited with 0.
    """
    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError as err:
        raise _changed("lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver") from err
    procs: list[subprocess.Popen] = []
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            procs.extend(private_attr(thread, "_child_processes", "lightning", *LIGHTNING_RANGE, _MODULE))
            thread._child_processes = []
    return procs


def set_received_sigterm(trainer: Any, value: bool) -> None:
    """Set the flag that makes Lightning raise ``SIGTERMException`` at the end of the batch (its pre-emption path).

    ``Trainer.received_sigterm`` is a read-only property over ``trainer._signal_connector.received_sigterm``.
    """
    connector = private_attr(trainer, "_signal_connector", "lightning", *LIGHTNING_RANGE, _MODULE)
    if not hasattr(connector, "received_sigterm"):
        raise _changed("_SignalConnector.received_sigterm")
    connector.received_sigterm = value


def module_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, ``None`` when none is (``module.trainer`` raises then)."""
    return private_attr(module, "_trainer", "lightning", *LIGHTNING_RANGE, _MODULE)


def fetch_hooks(trainer: Any) -> tuple[Any, Any, Any] | None:
    """``(loop, before, after)``: the training epoch loop and its ``_on_before_fetch``/``_on_after_fetch`` methods.

    The loop hands both to its data fetcher at every epoch start, which calls them right around ``next(iterator)``.
    ``None`` where this Lightning has no such hooks (callers then time the whole gap between steps).
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    before = getattr(loop, "_on_before_fetch", None)
    after = getattr(loop, "_on_after_fetch", None)
    if loop is None or not (callable(before) and callable(after)):
        return None
    return loop, before, after


def set_fetch_hooks(loop: Any, before: Any, after: Any) -> None:
    """Shadow the loop's fetch hooks with instance attributes (delete them to restore the methods)."""
    loop._on_before_fetch = before
    loop._on_after_fetch = after


def restore_fetch_hooks(loop: Any) -> None:
    """Remove what :func:`set_fetch_hooks` set, so the loop's own methods apply again."""
    for name in ("_on_before_fetch", "_on_after_fetch"):
        if name in vars(loop):
            delattr(loop, name)


def checkpoint_every_n_train_steps(callback: Any) -> int:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` as it resolved it (``0`` when it saves on another schedule)."""
    return int(private_attr(callback, "_every_n_train_steps", "lightning", *LIGHTNING_RANGE, _MODULE) or 0)


def save_last_checkpoint(callback: Any, trainer: Any) -> bool:
    """Write a ``ModelCheckpoint``'s ``last`` checkpoint now, as its own schedule would; ``False`` if it would not.

    Nothing is written where the callback itself skips saving (no fit, a step it saved at already) or where its
    monitored metric exists at this step (the parent saved, or defers to a validation about to run). The marker of
    the step last saved is left as it was, so a validation at this same step still writes the top-k checkpoint.
    """
    if private_attr(callback, "_should_skip_saving_checkpoint", "lightning", *LIGHTNING_RANGE, _MODULE)(trainer):
        return False
    candidates = private_attr(callback, "_monitor_candidates", "lightning", *LIGHTNING_RANGE, _MODULE)(trainer)
    if callback.monitor in candidates:
        return False
    saved_step = private_attr(callback, "_last_global_step_saved", "lightning", *LIGHTNING_RANGE, _MODULE)
    private_attr(callback, "_save_last_checkpoint", "lightning", *LIGHTNING_RANGE, _MODULE)(trainer, candidates)
    callback._last_global_step_saved = saved_step
    return True


class DeepSpeedStrategyHooks(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` with the private steps a subclass extends given public names.

    A subclass overrides ``format_config``, ``format_batch_size_and_grad_accum_config``,
    ``initialize_deepspeed_train`` or ``init_optimizers`` and calls ``super()`` as usual; the private methods of
    Lightning that run them are named here only.
    """

    def _format_config(self) -> None:
        self.format_config()

    def format_config(self) -> None:
        """Lightning's ``_format_config``: fill the DeepSpeed config from the Trainer's settings."""
        super()._format_config()

    def _format_batch_size_and_grad_accum_config(self) -> None:
        self.format_batch_size_and_grad_accum_config()

    def format_batch_size_and_grad_accum_config(self) -> None:
        """Lightning's ``_format_batch_size_and_grad_accum_config``: the batch keys of the DeepSpeed config."""
        super()._format_batch_size_and_grad_accum_config()

    def _initialize_deepspeed_train(self, model: Any) -> None:
        self.initialize_deepspeed_train(model)

    def initialize_deepspeed_train(self, model: Any) -> None:
        """Lightning's ``_initialize_deepspeed_train``: build the DeepSpeed engine for training."""
        super()._initialize_deepspeed_train(model)

    def _init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        return self.init_optimizers()

    def init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        """Lightning's ``_init_optimizers``: the module's optimizer and scheduler config for the engine."""
        return super()._init_optimizers()

    def init_deepspeed_distributed(self) -> None:
        """Lightning's ``_init_deepspeed_distributed``: DeepSpeed's process group on the ranks Lightning set up."""
        private_attr(self, "_init_deepspeed_distributed", "lightning", *LIGHTNING_RANGE, _MODULE)()

    def auto_select_batch_size(self) -> int:
        """Lightning's ``_auto_select_batch_size``: the micro-batch read from the train dataloader."""
        return int(private_attr(self, "_auto_select_batch_size", "lightning", *LIGHTNING_RANGE, _MODULE)())


class TrainDescriptionProgressBar(RichProgressBar):
    """Lightning's rich progress bar whose epoch description a subclass sets in ``describe_train_epoch``."""

    def _get_train_description(self, current_epoch: int) -> str:
        return self.describe_train_epoch(current_epoch)

    def describe_train_epoch(self, current_epoch: int) -> str:
        """Lightning's ``_get_train_description``: the text left of the bar during training."""
        return str(super()._get_train_description(current_epoch))


def shard_fully_when_auto(strategy: Any) -> None:
    """A ``ModelParallelStrategy`` left at ``data_parallel_size="auto"`` shards over every process, not per node.

    Lightning resolves ``"auto"`` to the number of nodes in ``setup_environment``; the value it reads is private.
    """
    if private_attr(strategy, "_data_parallel_size", "lightning", *LIGHTNING_RANGE, _MODULE) == "auto":
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes


def set_model_parallel_sizes(strategy: Any, data_parallel: int, tensor_parallel: int) -> None:
    """The sizes a ``ModelParallelStrategy`` builds its ``("data_parallel", "tensor_parallel")`` mesh from in
    ``setup_environment``, worked out by the caller (``ParallelDims``) once the world size is known; Lightning keeps
    them private and resolves ``"auto"`` otherwise (tensor parallel over a node, data parallel over nodes)."""
    private_attr(strategy, "_data_parallel_size", "lightning", *LIGHTNING_RANGE, _MODULE)
    private_attr(strategy, "_tensor_parallel_size", "lightning", *LIGHTNING_RANGE, _MODULE)
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Replace the device mesh a ``ModelParallelStrategy`` built (2-D) by ``mesh`` (e.g. HSDP's 3-D
    ``dp_replicate x dp_shard x tp``, which Lightning cannot build: Lightning #21059), for the strategy and for its
    LightningModule (``configure_model`` reads ``self.device_mesh``); both keep it in a private attribute."""
    private_attr(strategy, "_device_mesh", "lightning", *LIGHTNING_RANGE, _MODULE)
    strategy._device_mesh = mesh
    module = strategy.lightning_module
    if module is not None:
        private_attr(module, "_device_mesh", "lightning", *LIGHTNING_RANGE, _MODULE)
        module._device_mesh = mesh
