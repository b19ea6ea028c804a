"""A resume that the checkpoint's loader position cannot continue is refused before any process starts."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from lightning_trainopt.checkpoint.resume_check import check_resume, data_parallel_ranks
from lightning_trainopt.exceptions import ConfigError

STATE = {
    "version": 1,
    "epoch": 0,
    "samples_consumed": 40,
    "seed": 1234,
    "shuffle": True,
    "dataset_size": 1000,
    "batch_size": 2,
    "num_replicas": 2,
    "data_options": {"corpus": "stdlib_text"},
}


def _checkpoint(tmp_path, layout: str, state: dict) -> str:
    """A checkpoint holding only Lightning's loop state, in the layout of a single file, DeepSpeed or FSDP2."""
    saved = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [state]}}}, "global_step": 10}
    path = tmp_path / "last.ckpt"
    if layout == "file":
        torch.save(saved, path)
    elif layout == "deepspeed":
        (path / "checkpoint").mkdir(parents=True)
        torch.save({"module": {"w": torch.zeros(3)}, **saved}, path / "checkpoint" / "mp_rank_00_model_states.pt")
    else:
        path.mkdir()
        torch.save(saved, path / "meta.pt")
    return str(path)


def _cfg(devices=2, batch_size=2, callbacks=None):
    trainer = {"accelerator": "cpu", "devices": devices, "num_nodes": 1}
    return OmegaConf.create({"trainer": trainer, "data": {"batch_size": batch_size}, "callbacks": callbacks or {}})


@pytest.mark.parametrize("layout", ["file", "deepspeed", "fsdp"])
def test_another_global_batch_mid_epoch_is_refused_naming_the_batch_that_resumes(tmp_path, layout):
    ckpt = _checkpoint(tmp_path, layout, STATE)
    with pytest.raises(ConfigError) as err:
        check_resume(_cfg(devices=1, batch_size=2), ckpt)
    assert err.value.key == "data.batch_size"
    assert "resume with data.batch_size=4 on 1 rank" in str(err.value)


@pytest.mark.parametrize(("devices", "batch_size"), [(2, 2), (1, 4), (4, 1)])
def test_the_same_global_batch_on_any_number_of_ranks_resumes(tmp_path, devices, batch_size):
    check_resume(_cfg(devices=devices, batch_size=batch_size), _checkpoint(tmp_path, "file", STATE))


@pytest.mark.parametrize(
    "state",
    [
        {**STATE, "samples_consumed": 0},  # at an epoch's start
        {**STATE, "samples_consumed": 998},  # no full global batch left: the next epoch starts afresh
    ],
)
def test_a_position_at_an_epoch_boundary_resumes_with_any_batch(tmp_path, state):
    check_resume(_cfg(devices=1, batch_size=3), _checkpoint(tmp_path, "file", state))


def test_a_micro_batch_chosen_at_run_time_is_left_to_the_loader(tmp_path):
    finder = {"micro_batch_finder": {"_target_": "lightning_trainopt.callbacks.MicroBatchFinder"}}
    check_resume(_cfg(devices=1, batch_size=2, callbacks=finder), _checkpoint(tmp_path, "file", STATE))


def test_data_parallel_ranks_from_the_trainer_node():
    assert data_parallel_ranks({"devices": 4, "num_nodes": 2}) == 8
    assert data_parallel_ranks({"devices": [0, 1], "num_nodes": 1}) == 2
    assert data_parallel_ranks({"devices": "auto", "accelerator": "cpu"}) == 1
    assert data_parallel_ranks({"devices": "3"}) == 3
    assert data_parallel_ranks({"devices": 0}) is None


def _epochs(processed, completed):
    return {
        "global_step": 9,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": processed, "completed": completed}}}},
    }


@pytest.mark.parametrize(
    ("state", "trainer", "done"),
    [
        ({"global_step": 60}, {"max_steps": 60}, "step 60 of max_steps=60"),
        ({"global_step": 30}, {"max_steps": 60}, None),
        ({"global_step": 60}, {"max_steps": 100}, None),  # the same run extended: it continues
        ({"global_step": 60}, {"max_steps": -1}, None),
        (
            _epochs(3, 2),  # saved in on_train_epoch_end of the last epoch
            {"max_steps": -1, "max_epochs": 3},
            "3 epochs of max_epochs=3",
        ),
        (
            _epochs(2, 2),
            {"max_steps": -1, "max_epochs": 3},
            None,
        ),
    ],
)
def test_finished_training(state, trainer, done):
    from omegaconf import OmegaConf

    from lightning_trainopt.checkpoint.resume_check import finished_training

    assert finished_training(state, OmegaConf.create(trainer)) == done
