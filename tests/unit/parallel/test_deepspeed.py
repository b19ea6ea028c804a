from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy, to_deepspeed_cpu_adam


def _groups():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adagrad])
def test_cpu_adam_refuses_other_optimizers(opt_cls):
    with pytest.raises(IncompatibleConfigError, match="offload"):
        to_deepspeed_cpu_adam(opt_cls(_groups(), lr=0.1))


def _strategy(config, world_size=2):
    env = LightningEnvironment()
    env.set_world_size(world_size)
    s = TrainOptDeepSpeedStrategy(config=config, cluster_environment=env)
    s.set_world_ranks = lambda: None
    return s


def _trainer(accumulate):
    return SimpleNamespace(accumulate_grad_batches=accumulate)


def test_train_batch_size_derives_accumulation():
    s = _strategy({"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}})
    trainer = _trainer(1)
    s._reconcile_train_batch_size(trainer)
    assert trainer.accumulate_grad_batches == 64


def test_train_batch_size_consistent_accumulation_kept():
    s = _strategy({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8})
    trainer = _trainer(4)
    s._reconcile_train_batch_size(trainer)
    assert trainer.accumulate_grad_batches == 4


def test_train_batch_size_conflicting_accumulation_raises():
    s = _strategy({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8})
    with pytest.raises(ConfigError, match="trainer.accumulate_grad_batches=2"):
        s._reconcile_train_batch_size(_trainer(2))


def test_train_batch_size_not_divisible_raises():
    s = _strategy({"train_batch_size": 1000, "train_micro_batch_size_per_gpu": 48})
    with pytest.raises(ConfigError, match="train_batch_size"):
        s._reconcile_train_batch_size(_trainer(1))


def test_json_precision_block_must_match_trainer_precision():
    s = _strategy({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    s.precision_plugin = SimpleNamespace(precision="bf16-mixed")
    with pytest.raises(IncompatibleConfigError, match="fp16"):
        s._format_config()


@pytest.mark.parametrize("user_json", [False, True])
def test_too_few_optimizer_swap_buffers_for_adam_are_refused_before_training(user_json):
    key = (
        "strategy.config.zero_optimization.offload_optimizer.buffer_count"
        if user_json
        else "strategy.optimizer_buffer_count"
    )
    kwargs = (
        {"config": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "buffer_count": 2}}}}
        if user_json
        else {"stage": 3, "offload_optimizer": True, "offload_optimizer_device": "nvme", "optimizer_buffer_count": 2}
    )
    with pytest.raises(ConfigError, match="swaps 4 tensors") as err:
        TrainOptDeepSpeedStrategy(**kwargs)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"params_buffer_count": 0}, "strategy.params_buffer_count"),
        ({"params_buffer_size": 1.5}, "strategy.params_buffer_size"),
        ({"max_in_cpu": -1}, "strategy.max_in_cpu"),
        ({"sub_group_size": -3}, "strategy.sub_group_size"),
        (
            {"config": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 0}}}},
            "strategy.config.zero_optimization.offload_param.buffer_count",
        ),
    ],
)
def test_bad_zero3_offload_sizes_are_refused_naming_the_key(kwargs, key):
    if "config" not in kwargs:
        kwargs = {"stage": 3, "offload_parameters": True, "offload_params_device": "nvme", **kwargs}
    with pytest.raises(ConfigError) as err:
        TrainOptDeepSpeedStrategy(**kwargs)
    assert err.value.key == key


def test_negative_persistence_threshold_refused():
    with pytest.raises(ConfigError, match="param_persistence_threshold"):
        TrainOptDeepSpeedStrategy(stage=3, param_persistence_threshold=-1)
