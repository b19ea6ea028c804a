"""Helpers for the tests of ``_compat``: a failure names the upstream change and the file to update."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from lightning_trainopt._compat._guard import changed, installed, written_for


def require(condition: bool, dist: str, what: str, version_range: tuple[str, str], module: str) -> None:
    """Fail with ``"<dist> <version> changed <what> ...; update lightning_trainopt/_compat/<module>.py"``."""
    if not condition:
        pytest.fail(str(changed(dist, what, *version_range, module)), pytrace=False)


def params(func: Any) -> list[str]:
    """The parameter names of ``func`` without ``self``."""
    return [p for p in inspect.signature(func).parameters if p != "self"]


def require_in_range(dist: str, version_range: tuple[str, str], module: str) -> None:
    """The installed ``dist`` lies in the range the wrappers were written for, else: re-check them, then widen it."""
    if not written_for(dist, *version_range):
        pytest.fail(
            f"{dist} {installed(dist)} is outside the range lightning_trainopt/_compat/{module}.py was written "
            f"against (>={version_range[0]},<{version_range[1]}); re-check each wrapper there, then widen the range.",
            pytrace=False,
        )
