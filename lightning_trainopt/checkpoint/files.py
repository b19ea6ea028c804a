"""Crash-safe checkpoint writes: write to a staging path next to the target, make it durable, then swap it in.

A checkpoint is a file (DDP, one device) or a directory (DeepSpeed, FSDP2 sharded). The staging path is a hidden
sibling of the target (same directory, so the final rename never crosses a filesystem and never degrades into a copy
into the final name). A write that fails half-way (a full disk, a killed process) leaves only a staging path, which
is removed on failure; the previous checkpoint at the target path is untouched until the new one is complete,
fsync-ed (file and directory) and, for a directory, sealed with a manifest of its files (:data:`MANIFEST`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from lightning_trainopt.exceptions import CheckpointWriteError, cause_of_type

__all__ = [
    "BACKUP_MARK",
    "MANIFEST",
    "STAGING_MARK",
    "commit_staged",
    "discard_staged",
    "fsync_dir",
    "recover_interrupted_writes",
    "save_directory_checkpoint",
    "staging_path",
    "write_directory_atomic",
    "write_file_atomic",
    "write_text_atomic",
    "write_manifest",
]

STAGING_MARK = ".partial-"
BACKUP_MARK = ".replaced-"
# Written last into a directory checkpoint: its files and their sizes. A directory without it (or whose files no
# longer match it) is not a complete checkpoint.
MANIFEST = "trainopt-manifest.json"


def staging_path(final: str | os.PathLike[str]) -> str:
    """A fresh sibling path of ``final`` to write into (same directory, so the final rename stays on one filesystem)."""
    final = Path(final)
    return str(final.with_name(f".{final.name}{STAGING_MARK}{uuid.uuid4().hex[:8]}"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def discard_staged(staging: str | os.PathLike[str]) -> None:
    """Delete a staging path left by a failed write (no error if it is absent)."""
    _remove(Path(staging))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (whichever process wrote them: the page cache is shared)."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


def write_manifest(directory: str | os.PathLike[str]) -> None:
    """Seal a complete directory checkpoint: fsync its files, then write :data:`MANIFEST` listing each with its size."""
    root = Path(directory)
    _fsync_tree(root)
    parts = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST]
    files = {str(p.relative_to(root)): p.stat().st_size for p in parts}
    with open(root / MANIFEST, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(root)


def commit_staged(staging: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Move a complete staging file/directory to ``final``, replacing any previous checkpoint there.

    A file replaces atomically (``os.replace``). A directory cannot replace a non-empty directory in one step, so the
    old one is first renamed to a backup sibling, the new one renamed in, and the backup deleted: at every instant a
    complete checkpoint exists at ``final`` or at the backup path. The parent directory is fsync-ed afterwards, so the
    rename survives a power loss.

    Raises:
        FileNotFoundError: ``staging`` does not exist (the write never completed).
    """
    staging, final = Path(staging), Path(final)
    if not staging.exists():
        raise FileNotFoundError(f"staged checkpoint {staging} is missing; the write did not complete")
    final.parent.mkdir(parents=True, exist_ok=True)
    if staging.is_file() and not final.is_dir():
        os.replace(staging, final)
        fsync_dir(final.parent)
        return
    backup = None
    if final.exists() or final.is_symlink():
        backup = final.with_name(f".{final.name}{BACKUP_MARK}{uuid.uuid4().hex[:8]}")
        os.replace(final, backup)
    os.replace(staging, final)
    fsync_dir(final.parent)
    if backup is not None:
        _remove(backup)


def recover_interrupted_writes(ckpt_dir: str | os.PathLike[str]) -> list[str]:
    """Undo what a writer killed in ``ckpt_dir`` left behind: put back a checkpoint caught between
    :func:`commit_staged`'s two renames, and delete staging paths and leftover backups.

    A backup whose checkpoint name is free again is the previous complete checkpoint of a directory commit killed
    after moving it aside and before moving the new one in: it is renamed back. Every other staging or backup path is
    an unfinished or superseded write: it is removed (a killed writer never cleans up, and a model's checkpoint is
    large). Call it only where no write is under way (the run folder is locked by this run).

    Returns:
        One line per path restored or removed.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    done = []
    for path in sorted(root.iterdir()):
        name = path.name
        if not name.startswith("."):
            continue
        if BACKUP_MARK in name:
            final = root / name[1:].rsplit(BACKUP_MARK, 1)[0]
            if not (final.exists() or final.is_symlink()):
                os.replace(path, final)
                done.append(f"restored {final.name} from {name} (a commit was killed between its renames)")
                continue
        elif STAGING_MARK not in name:
            continue
        _remove(path)
        done.append(f"removed {name} (left by a killed write)")
    if done:
        fsync_dir(root)
    return done


def _write_error(path: str | os.PathLike[str], err: OSError) -> CheckpointWriteError:
    name = errno.errorcode.get(err.errno or 0, "")
    return CheckpointWriteError(os.fspath(path), f"{err.strerror or err}" + (f" ({name})" if name else ""))


# Below this many free bytes a failed write is put down to the full disk (torch.save to a path reports ENOSPC as a
# C++ stream error without the errno; a full filesystem keeps at most a few blocks free).
_FULL_BYTES = 64 * 1024


def _disk_full(path: str | os.PathLike[str]) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_BYTES


def _translate(path: str | os.PathLike[str], err: BaseException, where: str | os.PathLike[str]) -> BaseException:
    """The :class:`CheckpointWriteError` for a failed write: from the ``OSError`` behind ``err``, else from a full
    filesystem at ``where`` (checked before the partial write is removed); ``err`` itself for any other failure."""
    cause = cause_of_type(err, OSError)
    if cause is not None:
        return _write_error(path, cause)
    # safetensors (Rust) raises its own error, "I/O error: No space left on device (os error 28)", and may have
    # removed its partial file already, so the filesystem need not look full any more.
    if _disk_full(where) or "No space left on device" in str(err):
        return CheckpointWriteError(os.fspath(path), "No space left on device (ENOSPC: the filesystem is full)")
    return err


@contextmanager
def _committed(staging: str | os.PathLike[str], path: str | os.PathLike[str], translate: bool) -> Iterator[None]:
    """Rename ``staging`` to ``path`` when the block succeeds; otherwise remove it and re-raise (``translate``: an
    I/O failure or a full disk as :class:`CheckpointWriteError`). Whatever was at ``path`` is kept until the rename."""
    try:
        yield
        commit_staged(staging, path)
    except Exception as err:
        error = _translate(path, err, Path(path).parent) if translate else err
        discard_staged(staging)
        if error is err:
            raise
        raise error from err
    except BaseException:
        discard_staged(staging)
        raise


def _atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any], translate: bool = False) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(path)
    with _committed(staging, path, translate), open(staging, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> None:
    """Write a file checkpoint with ``write(f)`` into a staging file beside ``path``, fsync it, rename it in.

    Args:
        path: the checkpoint's final path.
        write: writes the bytes into the open binary file it is given (e.g. ``lambda f: torch.save(ckpt, f)``).

    Raises:
        CheckpointWriteError: the write failed with an ``OSError`` (ENOSPC, EDQUOT, EIO, ...); the staging file is
            removed and whatever was at ``path`` before is kept.
    """
    _atomic_write(path, write, translate=True)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace the text file ``path`` in one step (a reader, or a crash, never sees half of it).

    Raises:
        OSError: the write failed; ``path`` keeps its previous content.
    """
    _atomic_write(path, lambda f: f.write(text.encode()))


def write_directory_atomic(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Write a directory with ``write(staging)`` into a staging directory beside ``path``, fsync it, rename it in.

    For one process's directory output (an exported model): a reader of ``path`` sees nothing, or all of it. An
    empty directory at ``path`` is replaced.

    Raises:
        CheckpointWriteError: the write failed with an ``OSError``, or on a full filesystem (ENOSPC); the staging
            directory is removed and whatever was at ``path`` before is kept.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(staging_path(final))
    # safetensors and torch.save report a full disk as their own errors, without an errno: see _translate.
    with _committed(staging, final, translate=True):
        staging.mkdir()
        write(staging)
        _fsync_tree(staging)


def save_directory_checkpoint(strategy: Any, filepath: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Write a sharded (directory) checkpoint on every rank into one staging directory; commit it only if all succeed.

    The one implementation behind the DeepSpeed and FSDP2 strategies' ``save_checkpoint``. Every rank calls
    ``write(staging)`` (the strategy's own save into that directory); the ranks then agree whether every write
    succeeded (one all-reduce), because a rank whose disk filled must not let rank 0 commit a checkpoint that lacks
    its shard. On success rank 0 fsyncs the tree, writes :data:`MANIFEST` and renames the directory in; on failure
    rank 0 removes the staging directory and every rank raises.

    Args:
        strategy: the Lightning strategy (``broadcast``, ``barrier``, ``reduce_boolean_decision``,
            ``is_global_zero``).
        filepath: the checkpoint's final path.
        write: writes the checkpoint into the directory path it is given.

    Raises:
        CheckpointWriteError: a rank's write, or the commit, failed with an ``OSError``.
    """
    filepath = strategy.broadcast(os.fspath(filepath))
    staging = strategy.broadcast(staging_path(filepath))
    error: BaseException | None = None
    original: BaseException | None = None
    try:
        write(staging)
    except Exception as err:
        original, error = err, _translate(filepath, err, Path(staging).parent)
    all_ok = strategy.reduce_boolean_decision(error is None, all=True)
    if all_ok and strategy.is_global_zero:
        try:
            write_manifest(staging)
            commit_staged(staging, filepath)
        except OSError as err:
            original, error = err, _write_error(filepath, err)
    all_ok = strategy.reduce_boolean_decision(error is None, all=True)
    if all_ok:
        return
    if strategy.is_global_zero:
        discard_staged(staging)
    strategy.barrier("trainopt_save_discarded")
    if error is None:
        raise CheckpointWriteError(
            os.fspath(filepath), "another rank failed to write its part (its error is in its log)"
        )
    if error is original:
        raise error
    raise error from original
