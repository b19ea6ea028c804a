"""The typed run spec is read once from the composed train.py config, with each group's values as typed fields."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import open_dict

from lightning_trainopt.config.run_spec import RunSpec, run_spec
from lightning_trainopt.config.strategy import strategy_spec
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.precision import FP8PrecisionSpec
from tests.helpers.compose import compose_config


def test_the_default_config_reads_into_typed_groups():
    cfg = compose_config(["trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=3", "seed=7"])
    run = run_spec(cfg)
    assert isinstance(run, RunSpec)
    assert run.model.kind == "gpt"
    assert (run.data.batch_size, run.data.seq_len) == (3, cfg.data.seq_len)
    assert not run.data.batch_chosen_at_run_time
    assert not run.parallelism.strategy.chosen
    assert (run.parallelism.accelerator, run.parallelism.num_nodes, run.parallelism.dims.dp) == (
        "cpu",
        1,
        2,
    )
    assert run.precision.trainer_precision == "32-true"
    assert run.transforms == dataclasses.replace(run.transforms, compile=False)
    assert run.optimizer.target == cfg.optimizer._target_
    assert run.checkpointing.ckpt_path is None
    assert (run.launch.seed, run.launch.continue_on_oom) == (7, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.launch.seed = 1  # type: ignore[misc]


def test_a_strategy_and_a_precision_preset_are_their_specs():
    cfg = compose_config(["+strategy=zero3_offload", "precision=fp8", "trainer.accelerator=cpu", "compile=true"])
    run = run_spec(cfg)
    assert run.parallelism.strategy == strategy_spec(cfg.strategy)
    assert run.parallelism.strategy.shards_params
    assert run.parallelism.strategy.offloads_optimizer
    assert isinstance(run.precision, FP8PrecisionSpec)
    assert run.transforms.compile


def test_a_micro_batch_finder_marks_the_batch_as_chosen_at_run_time():
    cfg = compose_config(["callbacks=[default,micro_batch_finder]", "trainer.accelerator=cpu"])
    assert run_spec(cfg).data.batch_chosen_at_run_time


def test_a_seed_that_is_no_whole_number_is_refused_naming_the_key():
    cfg = compose_config(["trainer.accelerator=cpu"])
    with open_dict(cfg):
        cfg.seed = "abc"
    with pytest.raises(ConfigError) as err:
        run_spec(cfg)
    assert err.value.key == "seed"
