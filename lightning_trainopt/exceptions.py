"""The one exceptions module of lightning_trainopt.

Every error raised for user input names the config key, the value it got, and the fix.
"""

from __future__ import annotations

from typing import Any, TypeVar

_E = TypeVar("_E", bound=BaseException)

__all__ = [
    "cause_of_type",
    "CheckpointWriteError",
    "ConfigError",
    "ConfigKeysError",
    "ExportWriteError",
    "IncompatibleConfigError",
    "MissingDependencyError",
    "RunDirLockedError",
    "TrainOptError",
    "UnsupportedHardwareError",
    "install_command",
]


class TrainOptError(Exception):
    """Base class of every error lightning_trainopt raises on purpose."""


class ConfigError(TrainOptError, ValueError):
    """A config value is invalid.

    Args:
        key: the dotted config key, e.g. ``optimizer.lr``.
        value: the value it was given.
        fix: what to do instead, one sentence.
    """

    def __init__(self, key: str, value: Any, fix: str) -> None:
        self.key = key
        self.value = value
        self.fix = fix
        super().__init__(f"{key}={value!r} is invalid: {fix}")


class ConfigKeysError(ConfigError):
    """Config keys that do not fit what they are passed to, all reported at once.

    ``key``, ``value`` and ``fix`` are those of the first; the message has one line per key,
    ``key=value: fix`` (``key=???`` for an argument that is missing).

    Args:
        problems: ``(key, value, fix)`` for each key, e.g. ``("optimizer.betaz", [0.9, 0.9], "unknown argument of
            torch.optim.AdamW; did you mean betas?")``; at least one.
    """

    def __init__(self, problems: list[tuple[str, Any, str]]) -> None:
        self.problems = list(problems)
        self.key, self.value, self.fix = self.problems[0]
        lines = [
            f"{key}={'???' if isinstance(value, str) and value == '???' else repr(value)}: {fix}"
            for key, value, fix in self.problems
        ]
        if len(lines) == 1:
            message = lines[0]
        else:
            message = f"{len(lines)} config keys do not fit their targets:" + "".join(f"\n  {line}" for line in lines)
        ValueError.__init__(self, message)


def _shown(value: Any) -> str:
    """A value as the user would type it back: ``repr``, except OmegaConf's mark of a missing value, ``???``."""
    return "???" if isinstance(value, str) and value == "???" else repr(value)


class IncompatibleConfigError(TrainOptError, ValueError):
    """A combination of options is known to break (refused by a pre-flight check).

    Args:
        keys: the config keys and values involved, e.g. ``{"precision": "fp8", "strategy": "zero2"}``.
        reason: why the combination breaks (with a reference where there is one).
        fix: the alternative to use.
    """

    def __init__(self, keys: dict[str, Any], reason: str, fix: str) -> None:
        self.keys = dict(keys)
        self.reason = reason
        self.fix = fix
        combo = " + ".join(f"{k}={v!r}" for k, v in self.keys.items())
        super().__init__(f"{combo} is refused: {reason} Fix: {fix}")


class MissingDependencyError(TrainOptError, ImportError):
    """An optional dependency is not installed.

    Args:
        package: the import name that is missing.
        extra: the pip extra of lightning_trainopt that installs it.
        feature: what needs it.
    """

    def __init__(self, package: str, extra: str, feature: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(
            f"{feature} needs the package {package!r}, which is not installed. "
            f"Install it with: {install_command(extra)}"
        )


def install_command(extra: str) -> str:
    """``pip install torch==<installed> -e ".[extra]"``: the pin keeps pip from swapping the installed torch build."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pin = f"torch=={version('torch').split('+', 1)[0]} "
    except PackageNotFoundError:
        pin = ""
    return f'pip install {pin}-e ".[{extra}]"'


class UnsupportedHardwareError(TrainOptError, RuntimeError):
    """The requested feature cannot run on this machine's hardware."""


class CheckpointWriteError(TrainOptError, RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error); the run stops with ``status: failed``.

    The partial write has been removed and the checkpoints written before are kept, so the run can be resumed.

    Args:
        path: the checkpoint that was being written.
        reason: what went wrong, one line (e.g. ``No space left on device (ENOSPC)``).
    """

    # metrics.json's status of a sweep job that stopped on this error (the CLI records ``refused`` for user errors).
    status = "failed"

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"could not write checkpoint {path}: {reason}. The partial write was removed and the earlier checkpoints "
            "are kept. Free space there (or set callbacks.model_checkpoint.dirpath to another disk), then resume "
            "with ckpt_path=last."
        )


class ExportWriteError(TrainOptError, RuntimeError):
    """``trainopt-export`` could not write its output (a full disk, a quota, an I/O error).

    The export is written into a hidden folder beside ``--out`` and renamed into place only when complete, so the
    failed one is removed and nothing is left at ``--out`` that ``from_pretrained`` could take for a whole model.

    Args:
        path: the ``--out`` directory.
        reason: what went wrong, one line (e.g. ``No space left on device (ENOSPC)``).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"could not write --out={path}: {reason}. The partial export was removed; nothing was left at {path}. "
            "Free space there (or give --out on another disk), then export again."
        )


class RunDirLockedError(TrainOptError, RuntimeError):
    """Another live run holds the run folder (two commands with the same ``hydra.run.dir`` at once).

    Args:
        run_dir: the run folder.
        holder: who holds it, e.g. ``pid 4242 on host node1 since 2026-12-05T03:00:00Z``.
        fix: what to do, one sentence.
    """

    def __init__(self, run_dir: str, holder: str, fix: str) -> None:
        self.run_dir = run_dir
        self.holder = holder
        super().__init__(f"hydra.run.dir={run_dir!r} is in use by another run ({holder}): {fix}")


def cause_of_type(err: BaseException, kind: type[_E]) -> _E | None:
    """``err`` itself if it is a ``kind``, else the first ``kind`` on its ``__cause__``/``__context__`` chain.

    Wrappers re-raise what they caught (Hydra's ``InstantiationException`` ``from`` a target's error, torch.save's
    ``RuntimeError`` from the ``OSError`` of a failed write); the caller wants the error underneath.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
