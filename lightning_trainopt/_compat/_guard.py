"""Version ranges and the loud error for a private upstream attribute that is gone or changed."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import Version

__all__ = ["UpstreamChangedError", "changed", "installed", "private_attr", "written_for"]


class UpstreamChangedError(RuntimeError):
    """A private attribute of an upstream package that a ``_compat`` module wraps is gone or changed."""


@cache
def installed(dist: str) -> Version | None:
    """The installed version of distribution ``dist``, ``None`` when it is not installed."""
    try:
        return Version(version(dist))
    except PackageNotFoundError:
        return None


def written_for(dist: str, low: str, high: str) -> bool:
    """The installed ``dist`` lies in ``[low, high)``, the range a wrapper was written and tested against."""
    found = installed(dist)
    return found is not None and Version(low) <= found < Version(high)


def changed(dist: str, what: str, low: str, high: str, module: str) -> UpstreamChangedError:
    """The error naming the upstream change: the version found, the range written for, and the file to update."""
    found = installed(dist)
    return UpstreamChangedError(
        f"{dist} {found} changed {what} (written against {dist} >={low},<{high}); "
        f"update lightning_trainopt/_compat/{module}.py"
    )


def private_attr(owner: Any, name: str, dist: str, low: str, high: str, module: str) -> Any:
    """``getattr(owner, name)``, or :class:`UpstreamChangedError` naming the change when the attribute is gone."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise changed(
            dist, f"{getattr(owner, '__qualname__', type(owner).__qualname__)}.{name}", low, high, module
        ) from None
