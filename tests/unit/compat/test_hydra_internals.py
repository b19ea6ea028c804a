"""Hydra's ``run_and_report``, which ``_compat/hydra_internals.py`` wraps, is still there and still used by main."""

from __future__ import annotations

import inspect

import hydra._internal.utils as hydra_utils
import pytest

from lightning_trainopt._compat import hydra_internals as hi
from lightning_trainopt._compat._guard import UpstreamChangedError
from tests.unit.compat._upstream import params, require, require_in_range


def test_installed_hydra_is_in_the_range_written_for():
    require_in_range("hydra-core", hi.HYDRA_RANGE, "hydra_internals")


def test_run_and_report_is_there_and_hydra_main_goes_through_it():
    report = getattr(hydra_utils, "run_and_report", None)
    require(
        callable(report) and params(report) == ["func"],
        "hydra-core",
        "hydra._internal.utils.run_and_report(func)",
        hi.HYDRA_RANGE,
        "hydra_internals",
    )
    source = inspect.getsource(hydra_utils._run_hydra)
    require(
        "run_and_report(" in source,
        "hydra-core",
        "_run_hydra's use of run_and_report",
        hi.HYDRA_RANGE,
        "hydra_internals",
    )


def test_translation_applies_inside_the_block_and_is_undone_after():
    original = hydra_utils.run_and_report
    seen = []

    def translate(func):
        def wrapped():
            seen.append("translated")
            return func()

        return wrapped

    with hi.translate_run_errors(translate):
        assert hydra_utils.run_and_report(lambda: 7) == 7
    assert seen == ["translated"]
    assert hydra_utils.run_and_report is original


def test_a_hydra_without_run_and_report_is_named(monkeypatch):
    monkeypatch.delattr(hydra_utils, "run_and_report")
    changed = pytest.raises(UpstreamChangedError, match=r"hydra-core .*run_and_report.*hydra_internals\.py")
    with changed, hi.translate_run_errors(lambda f: f):
        pass
