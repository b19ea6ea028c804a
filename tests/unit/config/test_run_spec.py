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


def _config_nodes(value, path="run"):
    """Paths of the DictConfig/ListConfig values anywhere in a spec (dataclass fields, dicts, lists, tuples)."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(value, (DictConfig, ListConfig)):
        return [path]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [p for f in dataclasses.fields(value) for p in _config_nodes(getattr(value, f.name), f"{path}.{f.name}")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _config_nodes(v, f"{path}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _config_nodes(v, f"{path}[{i}]")]
    return []


def test_the_groups_built_as_objects_are_held_as_plain_values():
    cfg = compose_config(
        ["trainer.accelerator=cpu", "activations=checkpoint", "+strategy=fsdp", "precision=bf16", "logger=csv"]
    )
    run = run_spec(cfg)
    assert _config_nodes(run) == []
    assert run.optimizer.node["betas"] == [0.9, 0.95]
    assert isinstance(run.optimizer.node["betas"], list)
    assert run.optimizer.scheduler["_target_"] == cfg.scheduler._target_
    assert run.data.node["_target_"] == cfg.data._target_
    assert (run.model.kind, run.model.name, run.model.loss) == ("gpt", cfg.model.name, None)
    assert list(run.callbacks.nodes) == [k for k, v in cfg.callbacks.items() if v is not None]
    assert list(run.trainer.loggers) == ["csv"]
    assert run.trainer.options["accelerator"] == "cpu"
    assert run.transforms.nodes["activation_checkpointing"]["_target_"] == run.transforms.activations[0]
    assert run.parallelism.strategy_node["_target_"] == cfg.strategy._target_
    assert run.parallelism.on_cpu
    assert run.data.fixed_batch_size == run.data.batch_size


def test_a_micro_batch_finder_leaves_the_resume_check_no_fixed_batch():
    cfg = compose_config(["callbacks=[default,micro_batch_finder]", "trainer.accelerator=cpu", "data.batch_size=2"])
    assert run_spec(cfg).data.fixed_batch_size is None


# Hydra's own: the job's name in the run directory (conf/hydra/default.yaml), not a setting of the run.
_NOT_RUN_SETTINGS = {"task_name"}


def test_every_setting_of_train_yaml_is_read_into_the_spec():
    # A new top-level option goes in conf/train.yaml and in one section of RunSpec; this fails while it changes no
    # field (so train.py would have to read it from the DictConfig).
    from omegaconf import OmegaConf

    from lightning_trainopt.config.tree import CONF_DIR

    root = OmegaConf.load(CONF_DIR / "train.yaml")
    settings = [str(k) for k in root if k != "defaults" and k not in _NOT_RUN_SETTINGS]
    assert {"seed", "compile", "ckpt_path", "continue_on_oom"} <= set(settings)
    base = run_spec(compose_config(["trainer.accelerator=cpu"]))
    for key in settings:
        value = root[key]
        changed = (not value) if isinstance(value, bool) else value + 1 if isinstance(value, int) else "changed"
        run = run_spec(compose_config(["trainer.accelerator=cpu", f"{key}={str(changed).lower()}"]))
        assert run != base, f"{key}={changed} changes no field of RunSpec: read it in config/run_spec.py"
