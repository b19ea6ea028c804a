"""The strategy calls ``checkpoint.files.save_directory_checkpoint`` makes, answered for one process."""

from __future__ import annotations

from typing import Any


class OneProcess:
    """A stand-in strategy of one process: rank zero, broadcasts and reductions return their input."""

    is_global_zero = True

    def broadcast(self, obj: Any) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        return decision

    def barrier(self, name: str | None = None) -> None:
        pass
