"""ResumableCheckpoint: Lightning's ModelCheckpoint whose latest state never waits for a metric, and survives Ctrl-C."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

__all__ = ["ResumableCheckpoint"]


class ResumableCheckpoint(ModelCheckpoint):
    """:class:`~lightning.pytorch.callbacks.ModelCheckpoint` that keeps a resumable latest state at all times.

    Two differences from the parent, both about the latest state (``save_last``), never about the best (top-k):

    * ``every_n_train_steps`` writes ``last.ckpt`` on its schedule even while the monitored metric does not exist
      yet. Lightning defers every save to the next validation when ``monitor`` is missing, so
      ``ModelCheckpoint(monitor="val_loss", save_last=True, every_n_train_steps=10)`` saved nothing until the
      first validation (never, when validation comes later than the interruption). The top-k save still waits for
      the metric, and a validation at the same step still saves it.
    * An interrupted fit writes ``interrupted-step<N>.ckpt`` beside the others, so ``ckpt_path=<it>`` (train.py:
      ``ckpt_path=last``, the newest checkpoint) continues from the step it stopped at. SIGTERM (a cluster's
      preemption) is already turned by Lightning into a stop at the next step boundary on every rank; the first
      Ctrl-C (SIGINT) is made to do the same, because an interrupt in the middle of a step cannot be saved
      consistently by several processes. A second Ctrl-C aborts at once without saving (one process: still saved).

    Args:
        save_on_interrupt: write the interrupt checkpoint (and handle the first Ctrl-C as a graceful stop).
        *args: :class:`ModelCheckpoint` arguments.
        **kwargs: :class:`ModelCheckpoint` keyword arguments.

    Example::

        ResumableCheckpoint(dirpath="ckpt", monitor="val_loss", save_last=True, every_n_train_steps=500)
    """

    def __init__(self, *args: Any, save_on_interrupt: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.save_on_interrupt = save_on_interrupt
        self.interrupt_path: str | None = None
        self._previous_sigint: Any = None
        self._sigint = False

    # ----------------------------------------------------------------- latest state on schedule
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        every = self._every_n_train_steps
        self._stop_if_interrupted(trainer)
        if not self.save_last or self.monitor is None or every < 1 or trainer.global_step % every:
            return
        if self._should_skip_saving_checkpoint(trainer):
            return  # the parent saved at this step (the metric existed), or this is no fit
        candidates = self._monitor_candidates(trainer)
        if self.monitor in candidates:
            return  # the parent saved or deferred to a validation that is about to run
        saved_step = self._last_global_step_saved
        self._save_last_checkpoint(trainer, candidates)
        # A validation at this same step must still write the top-k checkpoint, which checks this marker.
        self._last_global_step_saved = saved_step

    # ----------------------------------------------------------------- interrupts
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.interrupt_path = None
        self._sigint = False
        if not self.save_on_interrupt or threading.current_thread() is not threading.main_thread():
            return
        self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_sigint()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self._restore_sigint()  # a second Ctrl-C raises KeyboardInterrupt at once
        self._sigint = True
        rank_zero_info(
            "\nCtrl-C: stopping after this step and saving a checkpoint (press Ctrl-C again to abort without one)."
        )

    def _stop_if_interrupted(self, trainer: pl.Trainer) -> None:
        """After a Ctrl-C on any rank, stop every rank at this same step boundary.

        The ranks agree first (one scalar all-reduce per step, beside the SIGTERM broadcast Lightning already makes
        every step): a Ctrl-C reaches each process at a slightly different moment, and ranks that stopped at
        different steps would pair mismatched collectives in the checkpoint save and hang. The stop itself is
        Lightning's preemption path: ``received_sigterm`` makes every rank raise ``SIGTERMException`` at the end of
        this batch.
        """
        if not self.save_on_interrupt:
            return
        stop = self._sigint
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            trainer._signal_connector.received_sigterm = True

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_sigint()
        if not self.save_on_interrupt or not isinstance(exception, (SIGTERMException, KeyboardInterrupt)):
            return
        if isinstance(exception, KeyboardInterrupt) and trainer.world_size > 1:
            rank_zero_warn(
                "Interrupted in the middle of a step on several processes: no checkpoint can be written consistently; "
                f"the newest one in {self.dirpath} stays the one to resume from."
            )
            return
        if self.dirpath is None or trainer.global_step == 0:
            return
        path = os.path.join(self.dirpath, f"interrupted-step{trainer.global_step:06d}.ckpt")
        trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        self.interrupt_path = path
        rank_zero_info(f"Interrupted at step {trainer.global_step}: saved {path} (resume with ckpt_path=<it>).")

    def summary(self) -> dict[str, Any]:
        """``{"checkpoint": {"last", "best", "interrupted"}}``: the paths to resume or evaluate from (or ``None``)."""
        return {
            "checkpoint": {
                "last": self.last_model_path or None,
                "best": self.best_model_path or None,
                "interrupted": self.interrupt_path,
            }
        }
