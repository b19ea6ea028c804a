"""A resume that the checkpoint's loader position cannot continue is refused before any process starts."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.checkpoint.resume_check import check_resume
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


@pytest.mark.parametrize("layout", ["file", "deepspeed", "fsdp"])
def test_another_global_batch_mid_epoch_is_refused_naming_the_batch_that_resumes(tmp_path, layout):
    ckpt = _checkpoint(tmp_path, layout, STATE)
    with pytest.raises(ConfigError) as err:
        check_resume(ckpt, 2, 1)
    assert err.value.key == "data.batch_size"
    assert "resume with data.batch_size=4 on 1 rank" in str(err.value)


@pytest.mark.parametrize(("devices", "batch_size"), [(2, 2), (1, 4), (4, 1)])
def test_the_same_global_batch_on_any_number_of_ranks_resumes(tmp_path, devices, batch_size):
    ckpt = _checkpoint(tmp_path, "file", STATE)
    assert devices * batch_size == STATE["batch_size"] * STATE["num_replicas"]  # the global batch it was read with
    check_resume(ckpt, batch_size, devices)
    with pytest.raises(ConfigError, match=f"resume with data.batch_size={batch_size} on {devices} rank"):
        check_resume(ckpt, batch_size + 1, devices)


@pytest.mark.parametrize(
    "state",
    [
        {**STATE, "samples_consumed": 0},  # at an epoch's start
        {**STATE, "samples_consumed": 998},  # no full global batch left: the next epoch starts afresh
    ],
)
def test_a_position_at_an_epoch_boundary_resumes_with_any_batch(tmp_path, state):
    check_resume(_checkpoint(tmp_path, "file", state), 3, 1)
    # The same batch mid-epoch is refused: the position decides.
    (tmp_path / "mid").mkdir()
    mid_epoch = _checkpoint(tmp_path / "mid", "file", STATE)
    with pytest.raises(ConfigError, match="data.batch_size=4"):
        check_resume(mid_epoch, 3, 1)


def test_a_micro_batch_chosen_at_run_time_is_left_to_the_loader(tmp_path):
    # train.py passes RunSpec.data.fixed_batch_size: None under a MicroBatchFinder (tests/unit/config/test_run_spec.py).
    ckpt = _checkpoint(tmp_path, "file", STATE)
    check_resume(ckpt, None, 1)
    with pytest.raises(ConfigError, match="data.batch_size=4"):  # the same batch, known, is refused
        check_resume(ckpt, 2, 1)


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
