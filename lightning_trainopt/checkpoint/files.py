"""Crash-safe checkpoint writes: write to a staging path next to the target, then swap it in.

A checkpoint is a file (DDP) or a directory (DeepSpeed, FSDP2 sharded). A write that dies half-way leaves only a
staging path behind; the previous checkpoint at the target path is untouched until the new one is complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

__all__ = ["commit_staged", "discard_staged", "staging_path", "STAGING_MARK", "BACKUP_MARK"]

STAGING_MARK = ".partial-"
BACKUP_MARK = ".replaced-"


def staging_path(final: str | os.PathLike[str]) -> str:
    """A fresh sibling path of ``final`` to write into (same directory, so the final rename stays on one filesystem)."""
    final = Path(final)
    return str(final.with_name(f".{final.name}{STAGING_MARK}{uuid.uuid4().hex[:8]}"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def discard_staged(staging: str | os.PathLike[str]) -> None:
    """Delete a staging path left by a failed write (no error if it is absent)."""
    _remove(Path(staging))


def commit_staged(staging: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Move a complete staging file/directory to ``final``, replacing any previous checkpoint there.

    A file replaces atomically (``os.replace``). A directory cannot replace a non-empty directory in one step, so the
    old one is first renamed to a backup sibling, the new one renamed in, and the backup deleted: at every instant a
    complete checkpoint exists at ``final`` or at the backup path.

    Raises:
        FileNotFoundError: ``staging`` does not exist (the write never completed).
    """
    staging, final = Path(staging), Path(final)
    if not staging.exists():
        raise FileNotFoundError(f"staged checkpoint {staging} is missing; the write did not complete")
    final.parent.mkdir(parents=True, exist_ok=True)
    if staging.is_file() and not final.is_dir():
        os.replace(staging, final)
        return
    backup = None
    if final.exists() or final.is_symlink():
        backup = final.with_name(f".{final.name}{BACKUP_MARK}{uuid.uuid4().hex[:8]}")
        os.replace(final, backup)
    os.replace(staging, final)
    if backup is not None:
        _remove(backup)
