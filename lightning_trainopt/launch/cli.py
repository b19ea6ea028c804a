"""Console entry points (``trainopt-train``, ``trainopt-plan``), which ``train.py`` and ``plan.py`` call."""

from __future__ import annotations

import atexit
import difflib
import gc
import json
import logging
import re
import sys
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import hydra

# Imported before Hydra configures logging: `lightning` gives its logger a console handler when first imported, and
# conf/hydra/default.yaml then routes that logger to Hydra's handlers. Imported later (inside the task), the handler
# would be added after Hydra's set-up and every Lightning line would print twice.
import lightning.pytorch  # noqa: F401
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from omegaconf import DictConfig

from lightning_trainopt._compat.hydra_internals import translate_run_errors
from lightning_trainopt.checkpoint.run_lock import RunDirLock, is_launching_rank
from lightning_trainopt.config.tree import CONF_DIR
from lightning_trainopt.exceptions import RunDirLockedError, TrainOptError, cause_of_type
from lightning_trainopt.launch.launcher import (
    adopt_submitit_local_ranks,
    detect_launch,
    die_with_parent,
    external_launch_argv,
    mark_launcher,
)
from lightning_trainopt.launch.multirun import (
    apply_child_command,
    child_errors,
    end_job,
    is_sweep_child,
    record_child_error,
    restore_env,
    snapshot_env,
    teardown_distributed,
)
from lightning_trainopt.launch.slurm import register_resolvers

__all__ = [
    "CONFIG_DIR",
    "hydra_error_line",
    "keep_earlier_hydra_record",
    "plan_main",
    "release_before_exit",
    "run_hydra",
    "train_main",
    "user_error",
]

CONFIG_DIR = str(CONF_DIR)

log = logging.getLogger(__name__)

_STAMP = "%Y-%m-%d_%H-%M-%S"

# Hydra's messages for an override it cannot apply (hydra-core 1.3).
_NOT_IN_DEFAULTS = re.compile(r"Could not override '([^']+)'\. No match in the defaults list\.\n.* use (\+\S+)")
_NOT_IN_CONFIG = re.compile(r"Could not override '([^']+)'\.\nTo append to your config use \+(\S+)")
_ALREADY_THERE = re.compile(r"Could not append to config\. An item is already at '([^']+)'\.\n.*prefix: '([^']+)'")


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _record(status: str, error: str) -> None:
    """A sweep job that did not train: ``metrics.json`` with its status and error, for the sweep summary."""
    errors = child_errors(_run_dir())
    if errors:
        error += "".join(f"; rank {rank}: {text}" for rank, text in errors.items())
    (_run_dir() / "metrics.json").write_text(json.dumps({"status": status, "error": error}, indent=2))


def _refuse(err: TrainOptError) -> None:
    """A user error: one clear line, no traceback, nothing saved before touched.

    In a sweep, the job is recorded as ``status: refused`` in its metrics.json and the sweep goes on (a ladder's
    rung that a pre-flight check refuses is a result, not a crash); a single run exits with code 2; a child rank of
    a sweep job leaves the error to its rank 0 (:func:`_leave_sweep_job`).
    """
    line = f"error: {err}"
    print(line, file=sys.stderr)
    _log_to_files(line)
    if is_sweep_child():
        _leave_sweep_job(str(err))
    if not _in_multirun() or isinstance(err, RunDirLockedError):
        sys.exit(2)  # (a locked folder: the other run's record there must not be overwritten)
    if getattr(err, "status", None) == "failed" and (_run_dir() / "metrics.json").is_file():
        return  # train() recorded the failed run with its figures (a checkpoint write that failed)
    _record(getattr(err, "status", "refused"), str(err))


def _fail(err: Exception) -> None:
    """A sweep job raised: its traceback on stderr and in train.log, ``status: failed`` in its metrics.json.

    The error is recorded rather than re-raised: Hydra's basic sweeper stops at a job that raises, so one crash
    would cost the jobs after it and the sweep summary. The sweep exits non-zero when no job succeeded.
    """
    error = f"{type(err).__name__}: {err}"
    traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    line = f"error: job failed: {error}"
    print(line, file=sys.stderr)
    _log_to_files(line, err)
    if is_sweep_child():
        _leave_sweep_job(error)
    _record("failed", error)


def _leave_sweep_job(error: str) -> None:
    """End a failed child rank of a sweep job: its error for rank 0, and exit code 0 (see ``launch.multirun``)."""
    record_child_error(_run_dir(), error)
    sys.exit(0)


def _log_to_files(line: str, err: BaseException | None = None) -> None:
    """Write ``line`` (and ``err``'s traceback) to the log files of the root logger (the run's ``train.log``).

    Hydra's job logging (``conf/hydra/default.yaml``) gives the root logger a console handler on stdout and a file
    handler on ``<run dir>/<job name>.log``. The line is already on stderr; logging it normally would print it a
    second time on the terminal, so only the file handlers get the record.
    """
    exc_info = (type(err), err, err.__traceback__) if err is not None else None
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, (), exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def user_error(err: BaseException) -> TrainOptError | None:
    """The :class:`TrainOptError` behind ``err``: itself, or the one a wrapper was raised from.

    Hydra's ``instantiate`` re-raises what a ``_target_``'s ``__init__`` raises as an ``InstantiationException``
    (``raise ... from e``), once per level of nesting, so the user error is found on the ``__cause__`` chain
    (``__context__`` where a wrapper did not say ``from``).
    """
    return cause_of_type(err, TrainOptError)


def hydra_error_line(err: BaseException) -> str | None:
    """The ``error:`` line for a Hydra error that a command-line override caused; ``None`` for any other error.

    * ``strategy=zero3``, a group that is not in the defaults list: use ``+strategy=zero3``;
    * ``trainer.max_step=20``, a key the config lacks: the nearest argument of what its node is passed to
      (``did you mean max_steps?``), or ``+`` for an argument that is valid but not in the config yet;
    * ``+trainer.max_steps=5``, a ``+`` for a key the config has: drop the ``+``;
    * ``model=nope``, no such preset: the nearest preset and the list of the group's presets.
    """
    from lightning_trainopt.config.keys import missing_key_fix
    from lightning_trainopt.config.validate import APP_TRAINER_KEYS

    text = str(err)
    if isinstance(err, MissingConfigException):
        if not err.options or not err.missing_cfg_file or "/" not in err.missing_cfg_file:
            return None
        group, _, name = err.missing_cfg_file.rpartition("/")
        close = difflib.get_close_matches(name, list(err.options), n=1, cutoff=0.6)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return f"{group}={name}: no such preset; {hint}conf/{group}/ has {', '.join(err.options)}."
    if not isinstance(err, ConfigCompositionException):
        return None
    if match := _NOT_IN_DEFAULTS.match(text):
        group, fixed = match.groups()
        return f"{fixed[1:]}: {group} is not in the defaults list; add it with a +: {fixed}"
    if match := _ALREADY_THERE.match(text):
        key, override = match.groups()
        return f"+{override}: {key} is already in the config; override it without the +: {override}"
    match = _NOT_IN_CONFIG.match(text)
    cause = err.__cause__
    if match is None or cause is None or not isinstance(getattr(cause, "full_key", None), str):
        return None
    override = match.group(2)
    path = str(getattr(cause, "full_key", ""))
    key = path.rpartition(".")[2]
    if path.startswith("trainer.") and path.count(".") == 1 and key in APP_TRAINER_KEYS:
        return f"{override}: train.py sets this Trainer argument; {APP_TRAINER_KEYS[key]}"
    return f"{override}: {missing_key_fix(path, getattr(cause, 'parent_node', None), override)}"


def _one_line_errors(func: Callable[[], Any]) -> Callable[[], Any]:
    """``func`` reporting what :func:`hydra_error_line` translates as one ``error:`` line with exit code 2."""

    def translated() -> Any:
        try:
            return func()
        except Exception as err:
            line = hydra_error_line(err)
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            sys.exit(2)

    return translated


def _guarded(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], None]:
    """``task`` with user errors reported plainly; in a sweep, a refused or failed job never ends the sweep.

    A sweep job that raises is recorded (``status: refused`` or ``failed``) and cleaned up after: its child ranks
    waited for, the process group torn down and the environment its launcher changed restored, so that the next
    job starts as the first did.
    """

    def run(cfg: DictConfig) -> None:
        adopt_submitit_local_ranks()  # a task of a submitit_local job of several: one rank of it
        in_sweep = _in_multirun()
        env = snapshot_env()
        lock = _job_lock()
        try:
            if lock is not None:
                lock.acquire()  # held already when run_hydra locked hydra.run.dir; a sweep job's own folder else
            task(cfg)
        except Exception as err:
            # A bad argument refused in a callback's or data module's __init__ reaches us wrapped by Hydra's
            # instantiate: the same user error as one refused by validate_config. Anything else (an import error,
            # a bug) keeps its traceback: re-raised in a single run, recorded as a failure in a sweep.
            cause = err if isinstance(err, TrainOptError) else None
            if isinstance(err, InstantiationException):
                cause = user_error(err)
            if cause is None and not (in_sweep or is_sweep_child()):
                raise
            if in_sweep:
                end_job()  # first: the record then holds the errors of the child ranks it waited for
            if cause is not None:
                _refuse(cause)
            else:
                _fail(err)
            if in_sweep:
                restore_env(env)
        finally:
            if lock is not None:
                lock.release()

    return run


def _job_lock() -> RunDirLock | None:
    """The lock of this job's run folder for the launching rank (none outside Hydra, e.g. a test calling the task)."""
    from hydra.core.hydra_config import HydraConfig

    if not is_launching_rank() or not HydraConfig.initialized():
        return None
    return RunDirLock.for_dir(_run_dir())


def _train_task(cfg: DictConfig) -> None:
    from lightning_trainopt.launch.train import train

    train(cfg)


def _plan_task(cfg: DictConfig) -> None:
    from lightning_trainopt.config.plan import plan_task

    plan_task(cfg)


def _has_trained(run_dir: Path) -> bool:
    """A command trained in ``run_dir``: it holds a checkpoint, or a ``metrics.json`` that is not a refusal."""
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
        return True
    metrics = run_dir / "metrics.json"
    if not metrics.is_file():
        return False
    try:
        return json.loads(metrics.read_text()).get("status") != "refused"
    except (ValueError, AttributeError):
        return True  # unreadable or not an object: keep the record, as for a run that trained


def _move_record_aside(hydra_dir: Path) -> None:
    """Move the top-level ``.hydra/*.yaml`` into ``.hydra/<time it was written>/``, as a later command's would be."""
    files = [p for p in hydra_dir.iterdir() if p.is_file()]
    stamp = datetime.fromtimestamp((hydra_dir / "config.yaml").stat().st_mtime).strftime(_STAMP)
    aside = hydra_dir / stamp
    n = 1
    while aside.exists():
        aside = hydra_dir / f"{stamp}_{n}"
        n += 1
    aside.mkdir()
    for path in files:
        path.rename(aside / path.name)


def keep_earlier_hydra_record(argv: list[str], now: datetime | None = None) -> list[str]:
    """``argv`` plus ``hydra.output_subdir=.hydra/<time>`` when it names a run directory that has trained.

    Hydra writes ``.hydra/{config,hydra,overrides}.yaml`` into the run directory before the task runs, so resuming
    a run (``hydra.run.dir=<run> ckpt_path=last``) or a refused command aimed at it would replace the record of how
    its checkpoints were trained. The top-level ``.hydra/`` belongs to the first command that trained there (the
    directory holds a checkpoint or a ``metrics.json`` other than a refusal); each later invocation gets its own
    ``.hydra/<time>/`` instead. A directory where nothing has trained yet (every earlier command was refused by the
    pre-flight checks, or crashed before its first checkpoint) does not keep its top-level record: it is moved
    aside into ``.hydra/<time it was written>/``, where it stays as a record of that command, and this command's
    record takes its place. Sweeps (``-m``) and commands that set ``hydra.output_subdir`` themselves (Lightning's
    DDP child processes) are left as they are.

    Args:
        argv: the command line, ``sys.argv``.
        now: the time of this invocation (default: now), which names its subfolder.
    """
    if any(a in ("-m", "--multirun") or a.lstrip("+").startswith("hydra.output_subdir=") for a in argv):
        return argv
    run_dirs = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("hydra.run.dir=")]
    if not run_dirs:
        return argv
    run_dir = Path(run_dirs[-1])
    hydra_dir = run_dir / ".hydra"
    if not (hydra_dir / "config.yaml").is_file():
        return argv
    if not _has_trained(run_dir):
        _move_record_aside(hydra_dir)
        return argv
    return [*argv, f"hydra.output_subdir=.hydra/{(now or datetime.now()).strftime(_STAMP)}"]


def run_hydra(task: Callable[[DictConfig], Any], config_name: str) -> None:
    """Run ``task`` under ``@hydra.main`` with this repository's ``conf/`` tree; user errors are reported plainly."""
    apply_child_command()
    lock = _lock_run_dir(sys.argv)
    try:
        sys.argv = keep_earlier_hydra_record(sys.argv)
        with translate_run_errors(_one_line_errors):
            hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=config_name)(_guarded(task))()
    finally:
        if lock is not None:
            lock.release()


def _lock_run_dir(argv: list[str]) -> RunDirLock | None:
    """Lock the ``hydra.run.dir`` a single run names, before Hydra writes anything there (exit 2 if it is in use).

    Only the launching rank locks (:func:`~lightning_trainopt.checkpoint.run_lock.is_launching_rank`); a sweep's
    jobs are locked one by one in their own folders by :func:`_guarded`.
    """
    if not is_launching_rank() or any(a in ("-m", "--multirun") for a in argv):
        return None
    run_dirs = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("hydra.run.dir=")]
    if not run_dirs:
        return None
    lock = RunDirLock.for_dir(run_dirs[-1])
    try:
        lock.acquire()
    except RunDirLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return lock


def train_main() -> None:
    """``trainopt-train`` / ``python train.py``, under any launcher (see :mod:`lightning_trainopt.launch.launcher`)."""
    launch = detect_launch()
    die_with_parent(launch)
    mark_launcher()
    try:
        sys.argv = external_launch_argv(sys.argv, launch)
    except TrainOptError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    atexit.register(release_before_exit)
    register_resolvers()  # hydra/launcher=slurm reads GPUs per node through one
    run_hydra(_train_task, "train")


def release_before_exit() -> None:
    """Tear the process group down and free the run's objects while the interpreter is still whole (at exit).

    What is left for the interpreter's finalization can abort the process there (SIGABRT), after a job that
    succeeded: a gloo group still alive holds tensors in its worker threads whose release needs the GIL while it is
    being torn down (torch PR 179291), and the Trainer, the DeepSpeed engine and their tensors live on in reference
    cycles until a collection that may only come during finalization. A run that succeeded has torn its group down
    already (``train()``); one that raised has not. Registered with ``atexit``, so the exit code is kept.
    """
    teardown_distributed()
    gc.collect()


def plan_main() -> None:
    """``trainopt-plan`` / ``python plan.py``."""
    run_hydra(_plan_task, "plan")
