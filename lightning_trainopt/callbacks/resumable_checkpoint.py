"""ResumableCheckpoint: Lightning's ModelCheckpoint whose latest state never waits for a metric, and survives Ctrl-C."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import (
    checkpoint_every_n_train_steps,
    save_last_checkpoint,
    set_received_sigterm,
)
from lightning_trainopt.exceptions import ConfigError

__all__ = ["ResumableCheckpoint"]

_KEY = "callbacks.model_checkpoint"


def _clock() -> float:
    """Seconds on a monotonic clock (a module function, so tests can replace the clock)."""
    return time.monotonic()


class ResumableCheckpoint(ModelCheckpoint):
    """:class:`~lightning.pytorch.callbacks.ModelCheckpoint` that keeps a resumable latest state at all times.

    Three differences from the parent, all about the latest state (``save_last``), never about the best (top-k):

    * ``every_n_train_steps`` writes ``last.ckpt`` on its schedule even while the monitored metric does not exist
      yet. Lightning defers every save to the next validation when ``monitor`` is missing, so
      ``ModelCheckpoint(monitor="val_loss", save_last=True, every_n_train_steps=10)`` saved nothing until the
      first validation (never, when validation comes later than the interruption). The top-k save still waits for
      the metric, and a validation at the same step still saves it.
    * ``every_n_minutes`` also writes ``last.ckpt`` at the first optimizer-step boundary after that many minutes of
      wall-clock time since the fit started or the last such save, beside a step schedule (Lightning's
      ``train_time_interval`` cannot be combined with ``every_n_train_steps``). On several processes the ranks
      agree in the all-reduce they make per optimizer step anyway (below), so they save at the same step.
    * An interrupted fit writes ``interrupted-step<N>.ckpt`` beside the others, so ``ckpt_path=<it>`` (train.py:
      ``ckpt_path=last``, the newest checkpoint) continues from the step it stopped at. SIGTERM (a cluster's
      preemption) is turned into a stop at the next optimizer-step boundary on every rank (Lightning's pre-emption
      path, the ranks agreeing first: below); the first Ctrl-C (SIGINT) is made to do the same, because an
      interrupt in the middle of a step cannot be saved consistently by several processes. A second Ctrl-C aborts
      at once without saving (one process: still saved).

    Args:
        save_on_interrupt: write the interrupt checkpoint (and handle the first Ctrl-C as a graceful stop).
        every_n_minutes: also write ``last.ckpt`` every this many minutes of training (``None``: off); needs
            ``save_last``.
        *args: :class:`ModelCheckpoint` arguments.
        **kwargs: :class:`ModelCheckpoint` keyword arguments.

    Raises:
        ConfigError: an argument Lightning would refuse with its own exception (``every_n_train_steps=-1``,
            ``save_top_k=-2``, ``mode="low"``, two save triggers at once), ``save_on_interrupt`` not a bool,
            ``every_n_minutes`` not a positive number or without ``save_last``; named as
            ``callbacks.model_checkpoint.<argument>``.

    Example::

        ResumableCheckpoint(dirpath="ckpt", monitor="val_loss", save_last=True, every_n_train_steps=500)
    """

    def __init__(
        self, *args: Any, save_on_interrupt: bool = True, every_n_minutes: float | None = None, **kwargs: Any
    ) -> None:
        _check_arguments(save_on_interrupt, kwargs)
        _check_minutes(every_n_minutes, kwargs.get("save_last"))
        super().__init__(*args, **kwargs)
        self.save_on_interrupt = save_on_interrupt
        self.every_n_minutes = every_n_minutes
        self._timer_start = 0.0
        self.interrupt_path: str | None = None
        self._previous_sigint: Any = None
        self._previous_sigterm: Any = None
        self._sigint = self._sigterm = False
        self._boundary_step = -1

    # ----------------------------------------------------------------- latest state on schedule
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == self._boundary_step:
            # A micro-batch that accumulates towards the next optimizer step: no save, no stop, no collective.
            self._hold_local_sigterm(trainer)
            return
        self._boundary_step = trainer.global_step
        if self._stop_if_interrupted(trainer):
            # Wall-clock time is up: last.ckpt now, whatever the metric (the parent has no time trigger here).
            self._timer_start = _clock()
            save_last_checkpoint(self, trainer, with_metric=True)
        every = checkpoint_every_n_train_steps(self)
        if not self.save_last or self.monitor is None or every < 1 or trainer.global_step % every:
            return
        # Skipped where the parent saved at this step (the metric existed) or defers to a validation about to run.
        save_last_checkpoint(self, trainer)

    # ----------------------------------------------------------------- interrupts
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.interrupt_path = None
        self._sigint = self._sigterm = False
        self._boundary_step = trainer.global_step
        self._timer_start = _clock()
        if not self.save_on_interrupt or threading.current_thread() is not threading.main_thread():
            return
        self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        if trainer.world_size > 1:
            # Lightning's handler sets the flag its loops read at once, on the rank that got the signal; between this
            # callback's agreement and Lightning's check of the flag, that rank alone would stop and enter the
            # checkpoint save while the others start the next step (a hang). The flag waits for the agreement.
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_signals()
        super().on_train_end(trainer, pl_module)  # Lightning writes last.ckpt here when nothing was saved yet

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, self._previous_sigint)  # a second Ctrl-C raises KeyboardInterrupt at once
        self._previous_sigint = None
        self._sigint = True
        rank_zero_info(
            "\nCtrl-C: stopping after this step and saving a checkpoint (press Ctrl-C again to abort without one)."
        )

    @property
    def stop_requested(self) -> bool:
        """A Ctrl-C or SIGTERM reached this process and the stop at the next optimizer-step boundary is pending.

        On several processes SIGTERM is recorded here, not in Lightning's ``trainer.received_sigterm``, until the
        ranks agree (see :meth:`_stop_if_interrupted`); code that waits for the signal reads this.
        """
        return self._sigint or self._sigterm

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._sigterm = True
        rank_zero_info("SIGTERM: every rank stops after this optimizer step and a checkpoint is saved.")

    def _hold_local_sigterm(self, trainer: pl.Trainer) -> None:
        """Between optimizer steps on several processes, keep a SIGTERM this rank saw for the next agreement.

        Lightning raises ``SIGTERMException`` at the end of any batch on a rank whose own flag is set; a rank that
        saw the signal a moment before the others would stop a batch earlier than they do and hang in the save.
        """
        if self.save_on_interrupt and trainer.world_size > 1 and trainer.received_sigterm:
            self._sigterm = True
            set_received_sigterm(trainer, False)

    def _stop_if_interrupted(self, trainer: pl.Trainer) -> bool:
        """After a Ctrl-C or SIGTERM on any rank, stop every rank at this same optimizer-step boundary; whether the
        ``every_n_minutes`` save is due (and no stop is).

        On several processes the ranks agree first: one all-reduce of two flags per optimizer step (not per
        micro-batch), beside the SIGTERM broadcast Lightning already makes every batch there. A signal reaches each
        process at a slightly different moment, and ranks that stopped (or saved) at different batches would pair
        mismatched collectives in the checkpoint save and hang; the clocks of the ranks differ too, so the save is
        due where any rank's clock says so. The stop itself is Lightning's preemption path: ``received_sigterm``
        makes every rank raise ``SIGTERMException`` at the end of this batch, after its optimizer step.
        """
        timed = self.every_n_minutes is not None
        if not self.save_on_interrupt and not timed:
            return False
        stop = self.save_on_interrupt and (self._sigint or self._sigterm or trainer.received_sigterm)
        due = timed and _clock() - self._timer_start >= 60 * (self.every_n_minutes or 0)
        if trainer.world_size > 1:
            flags = torch.tensor([int(stop), int(due)], device=trainer.strategy.root_device)
            stop, due = (bool(v) for v in trainer.strategy.reduce(flags, reduce_op="max").tolist())
        if self.save_on_interrupt:
            set_received_sigterm(trainer, stop)
        return due and not stop

    def _restore_signals(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_signals()
        super().on_exception(trainer, pl_module, exception)  # ModelCheckpoint(save_on_exception=True) still works
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
        """``{"checkpoint": {"last", "best", "interrupted"}}``: the paths to resume or evaluate from (or ``None``).

        A path whose write failed (Lightning records it before writing) is ``None``: there is nothing there.
        """
        paths = {"last": self.last_model_path, "best": self.best_model_path, "interrupted": self.interrupt_path}
        return {"checkpoint": {k: p if p and os.path.exists(p) else None for k, p in paths.items()}}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_minutes(every_n_minutes: Any, save_last: Any) -> None:
    """Refuse an ``every_n_minutes`` that is not a positive number, or one without ``save_last`` to write."""
    if every_n_minutes is None:
        return
    if not isinstance(every_n_minutes, (int, float)) or isinstance(every_n_minutes, bool) or every_n_minutes <= 0:
        raise ConfigError(
            f"{_KEY}.every_n_minutes", every_n_minutes, "use a number of minutes > 0 (e.g. 30), or null: off."
        )
    if not save_last:
        raise ConfigError(
            f"{_KEY}.every_n_minutes",
            every_n_minutes,
            f"it writes last.ckpt, which {_KEY}.save_last={save_last} turns off; set save_last: true.",
        )


def _check_arguments(save_on_interrupt: Any, kwargs: dict[str, Any]) -> None:
    """Refuse the keyword arguments ModelCheckpoint would reject (or misread), naming the config key and the fix."""
    if not isinstance(save_on_interrupt, bool):
        raise ConfigError(f"{_KEY}.save_on_interrupt", save_on_interrupt, "use true or false.")
    for key in ("every_n_train_steps", "every_n_epochs"):
        value = kwargs.get(key)
        if value is not None and (not _is_int(value) or value < 0):
            raise ConfigError(f"{_KEY}.{key}", value, "use a whole number >= 1 (0 or null: off).")
    top_k = kwargs.get("save_top_k", 1)
    if not _is_int(top_k) or top_k < -1:
        raise ConfigError(f"{_KEY}.save_top_k", top_k, "use -1 (keep all), 0 (none) or a positive number to keep.")
    mode = kwargs.get("mode", "min")
    if mode not in ("min", "max"):
        raise ConfigError(f"{_KEY}.mode", mode, "use min or max.")
    save_last = kwargs.get("save_last")
    if save_last not in (None, True, False, "link"):
        raise ConfigError(f"{_KEY}.save_last", save_last, "use true, false, null or link.")
    triggers = [key for key in ("every_n_train_steps", "every_n_epochs") if kwargs.get(key) not in (None, 0)]
    if kwargs.get("train_time_interval") is not None:
        triggers.append("train_time_interval")
    if len(triggers) > 1:
        raise ConfigError(
            f"{_KEY}.{triggers[1]}",
            kwargs.get(triggers[1]),
            f"it cannot be combined with {_KEY}.{triggers[0]}; set only one of every_n_train_steps, every_n_epochs "
            "and train_time_interval.",
        )
    if kwargs.get("monitor") is None and top_k not in (-1, 0, 1):
        raise ConfigError(
            f"{_KEY}.save_top_k", top_k, f"keeping the best {top_k} needs a metric: set {_KEY}.monitor, or use 1."
        )
