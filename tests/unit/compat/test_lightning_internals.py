"""Each private Lightning attribute ``_compat/lightning_internals.py`` wraps is still there, in the shape it expects."""

from __future__ import annotations

import subprocess
import sys

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from lightning_trainopt._compat import lightning_internals as li
from lightning_trainopt._compat._guard import UpstreamChangedError
from tests.unit.compat._upstream import params, require, require_in_range

RANGE = li.LIGHTNING_RANGE


def _require(condition: bool, what: str) -> None:
    require(condition, "lightning", what, RANGE, "lightning_internals")


@pytest.fixture(scope="module")
def trainer() -> pl.Trainer:
    return pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_installed_lightning_is_in_the_range_written_for():
    require_in_range("lightning", RANGE, "lightning_internals")


def test_child_process_observer_is_still_there_and_gives_its_children_up():
    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:
        _require(False, "lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver")
    _require(params(_ChildProcessObserver.__init__)[:2] == ["main_pid", "child_processes"], "_ChildProcessObserver")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    observer = _ChildProcessObserver(main_pid=-1, child_processes=[child], sleep_period=1)
    observer.start()
    try:
        assert li.take_observed_children() == [child]
        observer.join(timeout=10)
        assert not observer.is_alive(), "the observer did not end once its children were taken"
    finally:
        child.kill()
        child.wait()


def test_signal_connector_flag(trainer):
    li.set_received_sigterm(trainer, True)
    assert trainer.received_sigterm
    li.set_received_sigterm(trainer, False)
    assert not trainer.received_sigterm


def test_a_missing_private_attribute_names_the_change():
    with pytest.raises(
        UpstreamChangedError, match=r"lightning .* changed object\._signal_connector .*lightning_internals"
    ):
        li.set_received_sigterm(object(), True)


def test_module_trainer_of_a_detached_module_is_none():
    assert li.module_trainer(pl.LightningModule()) is None


def test_fetch_hooks_can_be_shadowed_and_restored(trainer):
    hooks = li.fetch_hooks(trainer)
    _require(hooks is not None, "_TrainingEpochLoop._on_before_fetch/_on_after_fetch")
    loop, before, after = hooks

    def mark() -> None:
        return None

    li.set_fetch_hooks(loop, mark, mark)
    assert loop._on_before_fetch is mark
    assert loop._on_after_fetch is mark
    li.restore_fetch_hooks(loop)
    assert loop._on_before_fetch == before
    assert loop._on_after_fetch == after


def test_model_checkpoint_privates():
    cb = ModelCheckpoint(every_n_train_steps=3)
    assert li.checkpoint_every_n_train_steps(cb) == 3
    _require(params(ModelCheckpoint._should_skip_saving_checkpoint) == ["trainer"], "_should_skip_saving_checkpoint")
    _require(params(ModelCheckpoint._monitor_candidates) == ["trainer"], "ModelCheckpoint._monitor_candidates")
    _require(
        params(ModelCheckpoint._save_last_checkpoint) == ["trainer", "monitor_candidates"],
        "ModelCheckpoint._save_last_checkpoint(trainer, monitor_candidates)",
    )
    _require(isinstance(cb._last_global_step_saved, int), "ModelCheckpoint._last_global_step_saved")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_format_config", []),
        ("_format_batch_size_and_grad_accum_config", []),
        ("_initialize_deepspeed_train", ["model"]),
        ("_init_optimizers", []),
        ("_init_deepspeed_distributed", []),
        ("_auto_select_batch_size", []),
    ],
)
def test_deepspeed_strategy_private_steps(name, expected):
    method = getattr(DeepSpeedStrategy, name, None)
    _require(callable(method) and params(method) == expected, f"DeepSpeedStrategy.{name}({', '.join(expected)})")


def test_rich_progress_bar_train_description():
    method = getattr(RichProgressBar, "_get_train_description", None)
    _require(callable(method) and params(method) == ["current_epoch"], "RichProgressBar._get_train_description")


def test_model_parallel_auto_data_parallel_size():
    strategy = ModelParallelStrategy()
    _require(getattr(strategy, "_data_parallel_size", None) == "auto", "ModelParallelStrategy._data_parallel_size")


def test_model_parallel_sizes_and_mesh_are_settable():
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    li.set_model_parallel_sizes(strategy, 2, 3)
    _require(
        (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 3),
        "ModelParallelStrategy._data_parallel_size/_tensor_parallel_size",
    )
    _require(hasattr(pl.LightningModule(), "_device_mesh"), "LightningModule._device_mesh")
    li.set_device_mesh(strategy, "mesh")
    _require(strategy.device_mesh == "mesh", "ModelParallelStrategy._device_mesh")


def test_path_type_matches_lightnings():
    from lightning.fabric.utilities.types import _PATH

    _require(li.PathLike == _PATH, "lightning.fabric.utilities.types._PATH")
