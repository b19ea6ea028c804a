"""The one slot through which the rooms below ``parallel/`` ask what a built strategy does.

``models/`` and ``precision/`` must answer questions about a user's own Lightning strategy (a ``DeepSpeedStrategy``
built around our modules, carrying no spec) without importing ``parallel/``, which sits above them. ``parallel/``
answers (``parallel.spec.spec_of``); the package's ``__init__`` registers a thunk that imports it on the first
question. This module imports nothing, so that importing the package stays cheap: ``train.py`` imports
``launch.launcher`` before torch, so that a rank whose launcher died ends at once (``die_with_parent``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["answer_strategies_with", "registered_answers"]

_ANSWERER: list[Callable[[Any], Any]] = []


def answer_strategies_with(answerer: Callable[[Any], Any]) -> None:
    """Register how a built strategy is answered (a ``StrategyQuestions`` for it); the last registration wins."""
    _ANSWERER[:] = [answerer]


def registered_answers(strategy: Any) -> Any:
    """The registered answerer's ``StrategyQuestions`` for ``strategy`` (``None`` when none is registered)."""
    return _ANSWERER[0](strategy) if _ANSWERER else None
