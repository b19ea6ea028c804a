"""What train.py keeps off the console, and what it prints instead."""

from __future__ import annotations

import logging
import os
import warnings

import pytest

from lightning_trainopt.launch.console import StepsProgressBar, model_line, quiet_console


class _Trainer:
    def __init__(self, max_epochs, max_steps):
        self.max_epochs, self.max_steps = max_epochs, max_steps


@pytest.mark.parametrize(
    ("max_epochs", "max_steps", "expected"),
    [(-1, 300, "Epoch 0"), (None, 300, "Epoch 0"), (3, -1, "Epoch 0/2")],
    ids=["max_steps", "no-epoch-bound", "max_epochs"],
)
def test_the_progress_bar_shows_no_negative_epoch_bound(max_epochs, max_steps, expected):
    bar = StepsProgressBar()
    bar._trainer = _Trainer(max_epochs, max_steps)  # what Lightning's Callback.setup stores
    assert bar._get_train_description(0).strip() == expected


def test_the_model_line_counts_frozen_parameters_when_there_are_some():
    assert model_line("m", 1000) == "model m: 1,000 parameters (1,000 trainable); FLOPs: SpeedMonitor's figures."
    assert "(10 trainable, 990 frozen)" in model_line("m", 1000, trainable=10)


def test_quiet_console_drops_third_party_deprecations_and_the_tip_only(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "unset")  # records the original, so teardown restores it
    monkeypatch.delenv("DS_ACCELERATOR")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_console(on_cpu=True)
        quiet_console(on_cpu=True)  # idempotent: one filter
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("your own FutureWarning stays", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["your own FutureWarning stays"]
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert len(rank_zero.filters) == 1
    tip = rank_zero.makeRecord(rank_zero.name, logging.INFO, __file__, 0, "💡 Tip: try a product", (), None)
    keep = rank_zero.makeRecord(rank_zero.name, logging.INFO, __file__, 0, "GPU available: False", (), None)
    assert not rank_zero.filters[0].filter(tip)
    assert rank_zero.filters[0].filter(keep)
    assert os.environ["DS_ACCELERATOR"] == "cpu"


def test_a_gpu_run_leaves_deepspeeds_accelerator_detection_alone(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "unset")  # records the original, so teardown restores it
    monkeypatch.delenv("DS_ACCELERATOR")
    quiet_console(on_cpu=False)
    assert "DS_ACCELERATOR" not in os.environ
