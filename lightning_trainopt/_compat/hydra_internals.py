"""Every private attribute of Hydra that the package touches.

Written against hydra-core >=1.3,<1.4 (:data:`HYDRA_RANGE`); ``tests/unit/compat/test_hydra_internals.py`` fails
naming the change when an upgrade renames or reshapes one of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_trainopt._compat._guard import changed

__all__ = ["HYDRA_RANGE", "translate_run_errors"]

#: The hydra-core versions these wrappers were written and tested against: ``[low, high)``.
HYDRA_RANGE = ("1.3", "1.4")


@contextmanager
def translate_run_errors(translate: Callable[[Callable[[], Any]], Callable[[], Any]]) -> Iterator[None]:
    """Inside the block, every call Hydra makes through ``hydra._internal.utils.run_and_report`` runs ``translate(f)``.

    ``@hydra.main`` composes the config, and reports a failure to, through ``run_and_report``: the only place its
    composition errors can be caught. ``translate`` wraps the function Hydra passes, so it sees the error before
    Hydra prints its own report. The original is restored on exit.

    Raises:
        UpstreamChangedError: this Hydra has no ``run_and_report(func)``.
    """
    try:
        import hydra._internal.utils as hydra_utils
    except ImportError as err:
        raise changed("hydra-core", "hydra._internal.utils", *HYDRA_RANGE, "hydra_internals") from err
    report = getattr(hydra_utils, "run_and_report", None)
    if report is None or list(inspect.signature(report).parameters) != ["func"]:
        raise changed("hydra-core", "hydra._internal.utils.run_and_report(func)", *HYDRA_RANGE, "hydra_internals")

    def run_and_report(func: Callable[[], Any]) -> Any:
        return report(translate(func))

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = report
