"""``train(cfg) -> dict``: assemble a Lightning Trainer from the typed run spec ``config/`` reads, fit, and report.

The composed config is handed to ``config/`` once (:func:`~lightning_trainopt.config.build.read_run`); from then on
this module reads typed values and the objects :func:`~lightning_trainopt.config.build.build_run` builds, never a
string key or a ``DictConfig``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, Timer
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig

from lightning_trainopt.callbacks import NonFiniteGuard, PrecisionReport, ResumableCheckpoint
from lightning_trainopt.callbacks._summary_table import callback_summaries, print_summary
from lightning_trainopt.checkpoint.files import write_text_atomic
from lightning_trainopt.checkpoint.io import use_atomic_checkpoint_io
from lightning_trainopt.checkpoint.verify import checkpoint_dir
from lightning_trainopt.config.build import build_run, config_runs_on_cpu, micro_batch, read_run, trainer_kwargs
from lightning_trainopt.config.model_factory import count_params, count_trainable_params
from lightning_trainopt.config.run_spec import DataSpec, LaunchSpec, RunSpec
from lightning_trainopt.exceptions import CheckpointWriteError, ConfigError
from lightning_trainopt.launch.console import StepsProgressBar, model_line, quiet_console
from lightning_trainopt.launch.launcher import check_launch
from lightning_trainopt.launch.multirun import prepare_child_command, restore_env, snapshot_env, teardown_distributed
from lightning_trainopt.launch.run_clock import RunClock
from lightning_trainopt.launch.slurm import newest_resume_point, retire_requeue_checkpoints
from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.report import StrategyReport
from lightning_trainopt.parallel.spec import precision_needs
from lightning_trainopt.precision import trainer_precision_kwargs

__all__ = [
    "early_stop",
    "finished_run",
    "output_dir",
    "resolve_ckpt_path",
    "run_status",
    "train",
    "validation_skip_reason",
]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
# The shell's code for a process ended by SIGINT (128 + 2): an interrupted run is not a success.
INTERRUPTED_EXIT_CODE = 130


def output_dir(launch: LaunchSpec) -> Path:
    """The run's output directory: Hydra's, else the config's ``output_dir``, else the working directory."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(launch.output_dir or os.getcwd())


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's callbacks (Lightning sets ``trainer.callbacks`` in a connector; the class does not declare it)."""
    return trainer.callbacks  # type: ignore[attr-defined]


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path, ckpt_dir: Path | None = None) -> str | None:
    """A checkpoint path as given; ``last``: the newest complete checkpoint under ``ckpt_dir`` (the checkpoint
    callback's ``dirpath``; default ``<run_dir>/checkpoints``); ``auto``: the same when there is one, else ``None``
    (start the run; the one command a pre-emptible job repeats).

    Either way the checkpoint is checked to be complete (its zip directory, or a directory checkpoint's manifest);
    ``last`` and ``auto`` skip newer incomplete ones with a warning naming them.

    Raises:
        ConfigError: the path does not exist or is not a complete checkpoint; ``last`` finds no complete one.
    """
    from lightning_trainopt.checkpoint.verify import (
        auto_resume_checkpoint,
        newest_complete_checkpoint,
        verify_checkpoint,
    )

    if ckpt_path is None:
        return None
    ckpt_dir = ckpt_dir or run_dir / "checkpoints"
    if ckpt_path == "last":
        return newest_complete_checkpoint(ckpt_dir)
    if ckpt_path == "auto":
        # Under SLURM, Lightning's requeue checkpoint (hpc_ckpt_<n>.ckpt in the run directory) counts too.
        return newest_resume_point(auto_resume_checkpoint(ckpt_dir), run_dir)
    if not Path(ckpt_path).exists():
        raise ConfigError(
            "ckpt_path", ckpt_path, "the checkpoint does not exist; give an existing path, 'last' or 'auto'."
        )
    verify_checkpoint(ckpt_path)
    return ckpt_path


def finished_run(trainer: Mapping[str, Any], ckpt_path: str, run_dir: Path) -> dict[str, Any] | None:
    """The kept ``metrics.json`` of a run that ``ckpt_path`` shows has already trained to its end; else ``None``.

    Resuming it would train no step and overwrite its results with empty ones (what an automatic retry after
    pre-emption does). Reading the checkpoint's state also refuses a corrupt one before anything starts.

    Args:
        trainer: the run's ``trainer`` arguments (``max_steps``, ``max_epochs``).
        ckpt_path: the checkpoint to resume from.
        run_dir: the run directory whose ``metrics.json`` is kept.

    Raises:
        ConfigError: the checkpoint's saved state cannot be read.
    """
    from lightning_trainopt.checkpoint.resume_check import finished_training
    from lightning_trainopt.checkpoint.verify import read_checkpoint_state

    done = finished_training(read_checkpoint_state(ckpt_path), trainer)
    if done is None:
        return None
    metrics_file = run_dir / METRICS_FILE
    try:
        kept: dict[str, Any] = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    except ValueError:
        kept = {}
    results = f"its {metrics_file} is kept" if kept else f"{metrics_file} is absent or unreadable: nothing to show"
    rank_zero_info(
        f"ckpt_path={ckpt_path} has finished training ({done}); nothing to resume, {results}. "
        "Raise trainer.max_steps to train further."
    )
    return kept


def _strategy_info(trainer: pl.Trainer, run: RunSpec) -> dict[str, Any]:
    if run.parallelism.strategy_node is None:
        return {"strategy": type(trainer.strategy).__name__.removesuffix("Strategy").lower(), "zero_stage": None}
    from lightning_trainopt.parallel import strategy_info

    return strategy_info(trainer)


def _final_validation(
    trainer: pl.Trainer, module: pl.LightningModule, dm: pl.LightningDataModule, clock: RunClock
) -> str:
    """Validate at the final step unless the fit loop just did, so ``val_loss`` describes the final weights.

    Returns metrics.json's ``final_validation``: ``"done"``, or ``"skipped: <reason>"`` when there is nothing to
    validate with (a user's module without ``validation_step``, data without ``val_dataloader``, or
    ``trainer.limit_val_batches=0``); Lightning's ``validate`` would raise at the end of a finished fit instead.
    """
    reason = validation_skip_reason(trainer, module, dm)
    if reason is not None:
        return f"skipped: {reason}"
    if clock.last_val_step != trainer.global_step:
        trainer.validate(module, datamodule=dm, verbose=False)
    return "done"


def validation_skip_reason(trainer: pl.Trainer, module: pl.LightningModule, dm: Any) -> str | None:
    """Why the run cannot validate (the module or the data has no validation), or ``None`` when it can."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("validation_step", module):
        return f"{type(module).__name__} has no validation_step"
    if dm is not None and not is_overridden("val_dataloader", dm):
        return f"{type(dm).__name__} has no val_dataloader"
    if not trainer.limit_val_batches:
        return "trainer.limit_val_batches=0"
    return None


def early_stop(trainer: pl.Trainer) -> dict[str, Any]:
    """``{"stopped_by", "stopped_at_step"}``: who ended the fit early through ``trainer.should_stop``, and when.

    ``NonFiniteGuard`` gives the step it stopped at, Lightning's ``EarlyStopping`` the step the fit ended at; a
    stop requested by another callback has ``stopped_by`` ``None``. Reaching ``trainer.max_time`` (Lightning's
    ``Timer``) is the end the config asked for, not an early stop. Both values are ``None`` when the fit ran to
    its end.

    Args:
        trainer: the Trainer right after ``fit`` (the next ``fit`` resets ``should_stop``).
    """
    stopped: dict[str, Any] = {"stopped_by": None, "stopped_at_step": None}
    if not trainer.should_stop:
        return stopped
    for cb in _callbacks(trainer):
        if isinstance(cb, NonFiniteGuard) and cb.stopped_at is not None:
            return {"stopped_by": type(cb).__name__, "stopped_at_step": cb.stopped_at}
        if isinstance(cb, EarlyStopping) and cb.stopped_epoch:
            return {"stopped_by": type(cb).__name__, "stopped_at_step": trainer.global_step}
    for cb in _callbacks(trainer):
        remaining = cb.time_remaining() if isinstance(cb, Timer) else None
        if remaining is not None and remaining <= 0:
            return stopped
    return {"stopped_by": None, "stopped_at_step": trainer.global_step}


def run_status(oom: bool, stopped_early: bool, train_loss: float | None) -> str:
    """metrics.json's ``status``: what became of the fit, the first of these that applies.

    ``oom``: an out-of-memory error was caught (``continue_on_oom=true``); ``stopped``: a callback ended the fit
    before its ``max_steps``/``max_epochs`` (:func:`early_stop`; ``NonFiniteGuard`` on non-finite steps);
    ``diverged``: the final training loss is NaN or infinite; ``ok`` otherwise. (A sweep job refused by a check
    before training is written as ``refused`` by the CLI.)

    Args:
        oom: the fit ran out of memory.
        stopped_early: a callback set ``trainer.should_stop``.
        train_loss: the final training loss, ``None`` when none was logged (e.g. a resume at ``max_steps``).
    """
    if oom:
        return "oom"
    if stopped_early:
        return "stopped"
    if train_loss is not None and not math.isfinite(train_loss):
        return "diverged"
    return "ok"


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the configured model and return the run's metrics (also written to ``metrics.json`` on rank 0).

    Every config value is checked before anything is built or spawned.

    Args:
        cfg: the composed config of ``conf/train.yaml``.

    Raises:
        ConfigError: a config value is invalid.
        IncompatibleConfigError: a combination of options is known to break.
    """
    quiet_console(on_cpu=config_runs_on_cpu(cfg))
    # The one read of the config: validated, pre-flight checked, and the ranks' split into replicas validated before
    # anything is spawned (the Trainer's strategy is checked against it again once it has set up:
    # ParallelDims.from_trainer). Below, only typed values.
    run = read_run(cfg, launch_check=check_launch)
    dims = run.parallelism.dims

    run_dir = output_dir(run.launch)
    ckpt_path = resolve_ckpt_path(run.checkpointing.ckpt_path, run_dir, checkpoint_dir(run.callbacks.nodes, run_dir))
    if ckpt_path is not None:
        from lightning_trainopt.checkpoint.resume_check import check_resume
        from lightning_trainopt.checkpoint.resume_match import check_resume_matches

        kept = finished_run(run.trainer.options, ckpt_path, run_dir)
        if kept is not None:
            return kept
        check_resume(ckpt_path, run.data.fixed_batch_size, dims.dp if dims is not None else None)
        check_resume_matches(ckpt_path, run.adapter, run.model.node, run.launch.seed, run.model.distill)
    pl.seed_everything(run.launch.seed, workers=True, verbose=False)

    precision = run.precision
    built = build_run(run)
    module, datamodule, strategy = built.module, built.datamodule, built.strategy
    clock = RunClock()
    callbacks = [
        clock,
        # StrategyReport is always on: metrics.json's per-rank memory_breakdown of model states comes from it.
        StrategyReport(),
        # What an FP8 or keep_fp32 preset did to the model (metrics.json's precision_layers); nothing otherwise.
        PrecisionReport(),
        *built.callbacks,
    ]

    env = snapshot_env()
    prepare_child_command(run_dir)
    kwargs = trainer_kwargs(run)
    if kwargs.get("enable_progress_bar", True):
        callbacks.append(StepsProgressBar())
    if "enable_model_summary" not in kwargs:
        # Lightning's table would show a FLOPs column of zeros (it counts only with an example_input_array).
        kwargs["enable_model_summary"] = False
        adapter = run.adapter.kind if run.adapter.enabled else None
        rank_zero_info(model_line(built.name, built.n_params, adapter=adapter))
    trainer = pl.Trainer(
        **kwargs,
        strategy=strategy,
        callbacks=callbacks,
        logger=built.loggers or False,
        default_root_dir=str(run_dir),
        **trainer_precision_kwargs(precision, precision_needs(strategy), run.parallelism.accelerator),
    )
    use_atomic_checkpoint_io(trainer.strategy)
    oom = False
    interrupted: SystemExit | None = None
    write_failed: CheckpointWriteError | None = None
    train_loss = None
    # The training figures as the fit left them: the final validation pass resets the callback metrics.
    after_fit: dict[str, Any] = {}
    stopped: dict[str, Any] = {"stopped_by": None, "stopped_at_step": None}
    final_validation = "not reached"
    info = _strategy_info(trainer, run)
    t0 = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        # Read before the final validation pass: it resets the callback metrics, and under DeepSpeed it
        # re-initialises the engine for inference (without ZeRO below stage 3).
        train_loss = trainer.callback_metrics.get("train_loss")
        after_fit = dict(trainer.callback_metrics)
        stopped = early_stop(trainer)
        info = _strategy_info(trainer, run)
        retire_requeue_checkpoints(trainer, run_dir)  # else Lightning validates the requeue checkpoint's weights
        final_validation = _final_validation(trainer, module, datamodule, clock)
    except CheckpointWriteError as err:
        # A full disk: the partial file is gone and the earlier checkpoints kept; record the run as failed, then
        # let the CLI report the one-line reason.
        write_failed = err
        train_loss = trainer.callback_metrics.get("train_loss")
    except torch.OutOfMemoryError:
        if not run.launch.continue_on_oom:
            raise
        oom = True
        log.error("out of memory; recorded as status=oom (continue_on_oom=true)")
    except SystemExit as err:
        # Ctrl-C or SIGTERM: Lightning stops the fit (SIGTERMException, or sys.exit after a second Ctrl-C) and
        # ResumableCheckpoint saves where it stopped; the run's figures so far are still written, then it exits.
        if trainer.state.status != TrainerStatus.INTERRUPTED:
            raise
        interrupted = err
        if train_loss is None:  # else the fit had ended and the final validation was interrupted
            train_loss = trainer.callback_metrics.get("train_loss")
        info = _strategy_info(trainer, run)
    wall = time.perf_counter() - t0

    loss = float(train_loss) if train_loss is not None else None
    status = "interrupted" if interrupted is not None else run_status(oom, stopped["stopped_at_step"] is not None, loss)
    if write_failed is not None:
        status = "failed"
    outcome: dict[str, Any] = {"status": status, **stopped, "final_validation": final_validation}
    if write_failed is not None:
        outcome["error"] = str(write_failed)
    if interrupted is not None:
        saved = [cb.interrupt_path for cb in _callbacks(trainer) if isinstance(cb, ResumableCheckpoint)]
        outcome["interrupt_checkpoint"] = next((path for path in saved if path), None)
    if status == "diverged":
        log.warning("the final train loss is %s: recorded as status=diverged", loss)
    metrics = _collect_metrics(
        run.data, trainer, module, built.name, clock, precision, outcome, wall, loss, info, after_fit
    )
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / METRICS_FILE, metrics_json(metrics))
        print_summary(metrics, run_dir / METRICS_FILE)
    teardown_distributed()
    restore_env(env)
    if write_failed is not None:
        raise write_failed
    if interrupted is not None:
        # Rank 0 reports the interrupt. The ranks Lightning started exit 0: its watcher on rank 0 kills rank 0 as
        # soon as a child exits non-zero, which would cut metrics.json short.
        code = INTERRUPTED_EXIT_CODE if os.environ.get("LOCAL_RANK", "0") == "0" else 0
        raise SystemExit(code) from interrupted
    return metrics


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def metrics_json(metrics: dict[str, Any]) -> str:
    """``metrics.json`` text: strict JSON, so NaN/Infinity (a diverged loss, a non-finite norm) become ``null``.

    ``json.dumps`` would write the bare tokens ``NaN``/``Infinity``, which strict parsers (``jq``, JavaScript,
    most dashboards) reject.
    """
    return json.dumps(_finite(metrics), indent=2, default=str, allow_nan=False)


def _collect_metrics(
    data: DataSpec,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    name: str,
    clock: RunClock,
    precision: Any,
    outcome: dict[str, Any],
    wall: float,
    train_loss: float | None,
    strategy_info: dict[str, Any],
    after_fit: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    cb = trainer.callback_metrics
    dims = clock.dims or ParallelDims.from_trainer(trainer)  # as read when training started, if it did
    # One rank's tokens count once per data-parallel replica: a tensor-parallel group's ranks read the same batches.
    tokens_this_run = clock.local_tokens * dims.dp
    # The micro-batch actually trained: a MicroBatchFinder sets the datamodule's batch_size (and accumulation).
    micro = micro_batch(data, getattr(trainer, "datamodule", None))
    seq_len = data.seq_len or getattr(getattr(trainer, "datamodule", None), "seq_len", None)
    per_step = micro * trainer.accumulate_grad_batches * dims.dp if micro is not None else None
    metrics: dict[str, Any] = {
        **outcome,
        "model": name,
        "n_params": count_params(module),
        "trainable_params": count_trainable_params(module),
        **strategy_info,
        "precision": precision.name,
        "trainer_precision": precision.trainer_precision,
        "world_size": dims.world_size,
        "data_parallel_size": dims.dp,
        "parallel_dims": dims.to_dict(),
        "devices": trainer.num_devices,
        "accelerator": type(trainer.accelerator).__name__.removesuffix("Accelerator").lower(),
        "micro_batch_size": micro,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "global_batch_size": per_step,
        "seq_len": seq_len,
        "global_step": trainer.global_step,
        "train_loss": train_loss,
        "val_loss": float(cb["val_loss"]) if "val_loss" in cb else None,
        "val_ppl": float(cb["val_ppl"]) if "val_ppl" in cb else None,
        "tokens_seen": trainer.global_step * per_step * seq_len if per_step and seq_len else None,
        "tokens_this_run": tokens_this_run,
        "tokens_per_sec": tokens_this_run / clock.train_seconds if clock.train_seconds > 0 else None,
        "train_seconds": clock.train_seconds,
        "wall_seconds": wall,
    }
    metrics.update(callback_summaries(_callbacks(trainer)))
    # train/* as the fit left them (the final validation pass reset them), val/* from that pass.
    metrics.update(_distill_metrics(module, {**(after_fit or {}), **cb}))
    return metrics


def _distill_metrics(module: pl.LightningModule, cb: Mapping[str, Any]) -> dict[str, Any]:
    """experiment=distill: the loss's two terms and the teacher (``n_params`` is the student's, the one trained)."""
    summary = getattr(module, "distill_summary", None)
    if not callable(summary):
        return {}
    terms = {k.replace("/", "_"): float(cb[k]) for k in ("train/ce", "train/kl", "val/ce", "val/kl") if k in cb}
    teacher = summary()
    return {**terms, "distill": teacher, "n_params": count_params(module) - (teacher["teacher_params"] or 0)}
