"""A real small filesystem for full-disk tests: a tmpfs of a few MiB, mounted as root, unmounted afterwards."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["resize_tmpfs", "small_tmpfs"]


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (e.g. ``"3m"``) at ``path`` for the block; skip the test where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def resize_tmpfs(path: Path, size: str) -> None:
    """Grow (or shrink) a tmpfs mounted by :func:`small_tmpfs`: the disk was freed."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)
