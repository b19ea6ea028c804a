"""Is a checkpoint complete? Cheap checks that need no weights read, and the choice of the checkpoint to resume from.

A file checkpoint (``torch.save``'s zip archive) is complete when its zip central directory, which ``torch.save``
writes last at the end of the file, is there and lists ``data.pkl`` and records that lie inside the file. A
directory checkpoint (DeepSpeed, FSDP2) is complete when it holds the manifest written after all its files
(:data:`~lightning_trainopt.checkpoint.files.MANIFEST`) and every file listed there has its recorded size.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_trainopt.checkpoint.files import BACKUP_MARK, MANIFEST, STAGING_MARK, recover_interrupted_writes
from lightning_trainopt.exceptions import ConfigError

__all__ = [
    "auto_resume_checkpoint",
    "checkpoint_dir",
    "checkpoint_problem",
    "newest_complete_checkpoint",
    "read_checkpoint_state",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

_FIX = "resume from another checkpoint (ckpt_path=<path>), or ckpt_path=last for the newest complete one."


def _file_problem(path: Path) -> str | None:
    size = path.stat().st_size
    if size == 0:
        return "the file is empty"
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            head = f.read(4)
        if head == b"PK\x03\x04":
            return f"the zip archive is truncated or damaged ({size:,} bytes, no end-of-archive record)"
        return "it is not a checkpoint (not a torch.save zip archive)"
    if not any(e.filename.endswith("/data.pkl") or e.filename == "data.pkl" for e in entries):
        return "the zip archive holds no data.pkl: it is not a torch.save checkpoint"
    for entry in entries:
        # The local header (30 bytes + name) and the data must lie inside the file.
        if entry.header_offset + 30 + len(entry.filename) + entry.compress_size > size:
            return f"the zip archive is damaged: {entry.filename} lies beyond the end of the file"
    return None


def _directory_problem(path: Path) -> str | None:
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"the checkpoint directory has no {MANIFEST} (its write did not finish, or it predates this check)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, size in files.items():
        part = path / name
        if not part.is_file():
            return f"{name} listed in {MANIFEST} is missing"
        if part.stat().st_size != size:
            return f"{name} has {part.stat().st_size:,} bytes, {MANIFEST} says {size:,} (truncated or replaced)"
    return None


def checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """What makes ``path`` an incomplete checkpoint, in a few words; ``None`` when it looks complete.

    Reads only the zip directory at the end of a file, or a directory's manifest and file sizes: no tensor is read,
    so it costs milliseconds for any size. It does not catch bytes flipped inside a complete file.
    """
    path = Path(path)
    try:
        if path.is_dir():
            return _directory_problem(path)
        if not path.is_file():
            return "it does not exist"
        return _file_problem(path)
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"


def verify_checkpoint(path: str | os.PathLike[str], key: str = "ckpt_path") -> None:
    """Refuse an incomplete checkpoint before anything is built.

    Raises:
        ConfigError: naming ``key``, the file and what is wrong with it.
    """
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(key, os.fspath(path), f"{problem}; {_FIX}")


def checkpoint_dir(callbacks: Mapping[str, Any], run_dir: Path) -> Path:
    """Where ``ckpt_path=last|auto`` looks: the ``dirpath`` of the run's checkpoint callback, else
    ``<run_dir>/checkpoints``.

    A run whose disk filled is told to set ``callbacks.model_checkpoint.dirpath`` to another disk and resume with
    ``ckpt_path=last``; that resume must look where its checkpoints now are.

    Args:
        callbacks: the ``callbacks`` group, ``name: node`` with interpolations resolved.
        run_dir: the run directory.
    """
    for node in callbacks.values():
        target = node.get("_target_") if isinstance(node, Mapping) else None
        dirpath = node.get("dirpath") if isinstance(node, Mapping) else None
        if isinstance(target, str) and target.endswith("Checkpoint") and isinstance(dirpath, str) and dirpath:
            return Path(dirpath).expanduser()
    return run_dir / "checkpoints"


def _candidates(ckpt_dir: Path) -> list[Path]:
    """The checkpoints in ``ckpt_dir``, newest first (staging and backup paths of unfinished writes left out)."""
    found = [
        p
        for p in ckpt_dir.iterdir()
        if p.name.endswith(".ckpt") and not p.name.startswith(".") and STAGING_MARK not in p.name
    ]
    found = [p for p in found if BACKUP_MARK not in p.name]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _scan(ckpt_dir: Path, mode: str) -> tuple[list[Path], Path | None, list[tuple[Path, str]]]:
    """``(candidates, newest complete one or None, newer ones skipped with their problem)`` of ``ckpt_dir``.

    What a killed write left in ``ckpt_dir`` is undone first
    (:func:`~lightning_trainopt.checkpoint.files.recover_interrupted_writes`), each step logged; each skipped newer
    checkpoint is named in a warning (``ckpt_path=<mode>: skipping ...``) when a complete one is found.
    """
    for line in recover_interrupted_writes(ckpt_dir):
        log.warning("%s: %s", ckpt_dir, line)
    found = _candidates(ckpt_dir) if ckpt_dir.is_dir() else []
    skipped: list[tuple[Path, str]] = []
    for path in found:
        problem = checkpoint_problem(path)
        if problem is None:
            for bad, why in skipped:
                log.warning("ckpt_path=%s: skipping %s, newer than %s but incomplete: %s", mode, bad, path.name, why)
            return found, path, skipped
        skipped.append((path, problem))
    return found, None, skipped


def _listing(skipped: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{p.name}: {why}" for p, why in skipped)


def newest_complete_checkpoint(ckpt_dir: str | os.PathLike[str]) -> str:
    """``ckpt_path=last``: the newest checkpoint in ``ckpt_dir`` that is complete (:func:`checkpoint_problem`).

    Each newer checkpoint that is skipped is named in a warning with what is wrong with it. What a killed write left
    in ``ckpt_dir`` is undone first (:func:`~lightning_trainopt.checkpoint.files.recover_interrupted_writes`), each
    step logged.

    Raises:
        ConfigError: no checkpoint in ``ckpt_dir``, or none of them is complete (each is listed with its problem).
    """
    ckpt_dir = Path(ckpt_dir)
    found, good, skipped = _scan(ckpt_dir, "last")
    if good is not None:
        return str(good)
    if not found:
        raise ConfigError(
            "ckpt_path",
            "last",
            f"no checkpoint in {ckpt_dir}; point hydra.run.dir at the run to resume, or give a checkpoint path.",
        )
    raise ConfigError(
        "ckpt_path",
        "last",
        f"no complete checkpoint in {ckpt_dir} ({_listing(skipped)}); start the run afresh (ckpt_path=null, another "
        "hydra.run.dir) or give a checkpoint from elsewhere.",
    )


def auto_resume_checkpoint(ckpt_dir: str | os.PathLike[str]) -> str | None:
    """``ckpt_path=auto``: the newest complete checkpoint in ``ckpt_dir``, or ``None`` to start the run.

    The one command a pre-emptible job repeats: the first attempt finds no checkpoint and starts, every later one
    resumes where the last complete checkpoint left it. Incomplete checkpoints (a write killed half-way) are skipped
    with a warning naming each; when none is complete the run starts afresh with a warning, since refusing would leave
    an automatically requeued job failing for ever on files it cannot use. What a killed write left is undone first,
    as for ``ckpt_path=last`` (:func:`newest_complete_checkpoint`).
    """
    ckpt_dir = Path(ckpt_dir)
    found, good, skipped = _scan(ckpt_dir, "auto")
    if good is not None:
        log.info("ckpt_path=auto: resuming from %s.", good)
        return str(good)
    if not found:
        log.info("ckpt_path=auto: no checkpoint in %s; starting the run.", ckpt_dir)
    else:
        log.warning(
            "ckpt_path=auto: no complete checkpoint in %s (%s); starting the run afresh.", ckpt_dir, _listing(skipped)
        )
    return None


def read_checkpoint_state(path: str | os.PathLike[str], key: str = "ckpt_path") -> Mapping[str, Any]:
    """Lightning's state in the checkpoint (:func:`~lightning_trainopt.checkpoint.state.lightning_state`), or a clear
    error when it cannot be unpickled.

    Raises:
        ConfigError: the checkpoint is incomplete, or its ``data.pkl`` cannot be read.
    """
    from lightning_trainopt.checkpoint.state import lightning_state

    verify_checkpoint(path, key)
    try:
        return lightning_state(Path(path))
    except FileNotFoundError as err:
        raise ConfigError(key, os.fspath(path), f"{err}; {_FIX}") from err
    except Exception as err:  # torch.load's errors are RuntimeError, UnpicklingError, EOFError, ...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(key, os.fspath(path), f"its saved state cannot be read ({reason}); {_FIX}") from err
