"""The monitors' shared step-edge and logging-window bookkeeping (``callbacks/_common.py``), without a Trainer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_trainopt.callbacks._common import FitRestore, StepEdge, check_counting_args, resolve_hardware
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.hardware import hardware_spec


def _closes(edge: StepEdge, trainer: SimpleNamespace, steps: list[int]) -> list[int]:
    """The steps at which ``window_closed`` says yes, one call per micro-batch end."""
    out = []
    for step in steps:
        trainer.global_step = step
        if edge.window_closed(trainer):
            out.append(step)
    return out


def test_window_closes_once_per_step_under_accumulation_and_is_fixed_at_reset():
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=3)
    edge = StepEdge()
    edge.reset(trainer, None)
    assert edge.every == 3
    # Accumulation 2: every step number is seen at two micro-batch ends; each closes at most once.
    trainer.log_every_n_steps = 5  # changed after fit start: this fit keeps the window it started with
    assert _closes(edge, trainer, [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]) == [3, 6]


def test_own_window_wins_over_the_trainers():
    trainer = SimpleNamespace(global_step=4, log_every_n_steps=50)
    edge = StepEdge()
    edge.reset(trainer, 2)
    assert _closes(edge, trainer, [4, 5, 6, 7, 8]) == [6, 8]  # step 4 is where the fit (re)started: no edge


def test_counting_args_name_the_callbacks_key():
    with pytest.raises(ConfigError, match="callbacks.cost_monitor.tokens_fn"):
        check_counting_args("callbacks.cost_monitor", None, None, None, "not callable")
    with pytest.raises(ConfigError, match="callbacks.speed_monitor.log_every_n_steps"):
        check_counting_args("callbacks.speed_monitor", None, 0, None, None)
    spec = hardware_spec("a100_80gb")
    assert resolve_hardware(spec) is spec
    assert resolve_hardware("a100_80gb").name == spec.name


def test_fit_restore_counts_a_load_for_the_next_fit_only():
    at0, at7 = SimpleNamespace(global_step=0), SimpleNamespace(global_step=7)
    r = FitRestore()
    assert r.new_run(at0)  # nothing restored, step 0: a new run
    assert not r.new_run(at7)  # a fit that starts at step 7 continues whatever the monitor holds
    r.loaded()  # before fit (no stage): counts for the next fit
    assert not r.new_run(at0)
    assert r.new_run(at0)  # used up: the fit after it is new again
    r.stage = "validate"
    r.loaded()  # a validate-time restore starts no fit
    r.stage = "fit"
    assert r.new_run(at0)
    r.loaded()  # Lightning's restore after setup("fit")
    r.end()  # that fit raised: the restore is not carried to the next one
    assert r.new_run(at0)
    r.loaded(running=True)  # loaded while training: this fit's, not the next one's
    assert r.new_run(at0)
