"""Record every call that hands a ``DictConfig``/``ListConfig`` to code below ``config/``.

Issue #20: ``config/`` reads the Hydra config once; below it, nothing sees a raw config node. A profile hook
(``sys.setprofile``, this thread) inspects the arguments of each Python call that enters

* a module of ``lightning_trainopt`` below ``config/`` (``callbacks``, ``parallel``, ``models``, ``data``, ...), or
* third-party code (Lightning, torch, transformers, ...; not Hydra or OmegaConf themselves) called from our package
  or called by Hydra (``instantiate``, and the partials it returns) (a preset's target receives the node's values),

and records those that hold a config node (at the top, or inside a dict, list or tuple). Built-in functions take no
frame and are not seen.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from omegaconf import DictConfig, ListConfig

import lightning_trainopt

_PACKAGE = str(Path(lightning_trainopt.__file__).parent) + os.sep
# The layers allowed to hold config nodes: config/ reads them, launch/ and experiments/ pass them to config/.
_ABOVE = tuple(_PACKAGE + name + os.sep for name in ("launch", "experiments", "config", "conf"))
_CONFIG_LIBRARIES = tuple(
    str(Path(sysconfig.get_paths()["purelib"]) / name) + os.sep for name in ("omegaconf", "hydra", "_pytest", "pluggy")
)
_HYDRA = str(Path(sysconfig.get_paths()["purelib"]) / "hydra") + os.sep
_SITE = sysconfig.get_paths()["purelib"] + os.sep


@dataclass
class Leak:
    """One call that received a config node: the function, where it was called from, and the argument."""

    function: str
    caller: str
    argument: str
    node_type: str

    def __str__(self) -> str:
        return f"{self.function}({self.argument}: {self.node_type}) called from {self.caller}"


@dataclass
class Guard:
    """The calls seen so far; ``leaks`` holds one :class:`Leak` per distinct (function, argument)."""

    leaks: list[Leak] = field(default_factory=list)
    calls_checked: int = 0
    _seen: set[tuple[str, str]] = field(default_factory=set)


def _is_node(value: Any, depth: int = 2) -> str | None:
    """The type name of a config node in ``value`` (itself, or in a dict/list/tuple up to ``depth`` levels)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return type(value).__name__
    if depth <= 0:
        return None
    if isinstance(value, dict):
        items: Any = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return None
    for item in items[:64]:
        found = _is_node(item, depth - 1)
        if found is not None:
            return found
    return None


def _below_config(filename: str) -> bool:
    if filename.startswith(_PACKAGE):
        return not filename.startswith(_ABOVE)
    return filename.startswith(_SITE) and not filename.startswith(_CONFIG_LIBRARIES)


def _watched(callee: str, caller: str) -> bool:
    if callee.startswith(_PACKAGE):
        return _below_config(callee)
    if not _below_config(callee):
        return False
    return caller.startswith(_PACKAGE) or caller.startswith(_HYDRA)


def _arguments(frame: FrameType) -> Iterator[tuple[str, Any]]:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:n])
    if code.co_flags & 0x04:  # *args
        names.append(code.co_varnames[n])
        n += 1
    if code.co_flags & 0x08:  # **kwargs
        names.append(code.co_varnames[n])
    local = frame.f_locals
    for name in names:
        if name != "self" and name in local:
            yield name, local[name]


@contextmanager
def no_config_below_config() -> Iterator[Guard]:
    """Run the body with the profile hook installed; the yielded :class:`Guard` lists what leaked."""
    guard = Guard()

    def hook(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller_frame = frame.f_back
        caller = caller_frame.f_code.co_filename if caller_frame is not None else ""
        if not _watched(callee, caller):
            return
        guard.calls_checked += 1
        for name, value in _arguments(frame):
            node_type = _is_node(value)
            if node_type is None:
                continue
            function = f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_qualname}"
            if (function, name) in guard._seen:
                continue
            guard._seen.add((function, name))
            where = f"{caller}:{caller_frame.f_lineno}" if caller_frame is not None else "?"
            guard.leaks.append(Leak(function, where, name, node_type))

    previous = sys.getprofile()
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        yield guard
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)  # type: ignore[arg-type]
