"""plan.py refuses what train.py refuses, and a search that could enumerate nothing, with our exceptions."""

from __future__ import annotations

import pytest

from lightning_trainopt.config.plan import plan, plan_task
from lightning_trainopt.config.validate import validate_config
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.compose import compose_config

BASE = ["model=llama_7b", "hardware=a100_80gb", "trainer.devices=4", "+strategy=zero2", "precision=bf16"]
SEARCH = [*BASE, "data.batch_size=1", "data.seq_len=2048", "plan.search=true"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("plan.search_space.strategy=[zero9]", "plan.search_space.strategy"),
        ("plan.search_space.activations=[checkpointing]", "plan.search_space.activations"),
        ("plan.search_space.optimizer=[adamw9bit]", "plan.search_space.optimizer"),
        ("plan.search_space.precision=[fp12]", "plan.search_space.precision"),
        ("plan.search_space.strategy=[]", "plan.search_space.strategy"),
        ("plan.search_space.micro_batch=[0]", "plan.search_space.micro_batch"),
        ("plan.search_space.micro_batch=[-1]", "plan.search_space.micro_batch"),
        ("plan.search_space.micro_batch=[1.5]", "plan.search_space.micro_batch"),
    ],
)
def test_a_search_space_that_names_nothing_valid_is_refused(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        plan(compose_config([*SEARCH, override], tmp_path, name="plan"))


def test_an_unknown_preset_is_refused_with_the_valid_choices(tmp_path):
    with pytest.raises(
        ConfigError, match=r"plan.search_space.strategy='zero9' is invalid: use presets that exist: .*zero2.*zero3"
    ):
        plan(compose_config([*SEARCH, "plan.search_space.strategy=[zero2,zero9]"], tmp_path, name="plan"))


def test_micro_batches_that_divide_nothing_name_the_global_batch(tmp_path):
    # data.batch_size=1 x accumulate 1 x 4 devices: 1 sequence per device per step; 3 and 5 do not divide it.
    overrides = [*SEARCH, "plan.search_space.micro_batch=[3,5]"]
    with pytest.raises(ConfigError, match=r"global batch of 4 sequences.*divisors of 1: \[1\]"):
        plan(compose_config(overrides, tmp_path, name="plan"))


def test_a_search_train_py_refuses_entirely_is_refused(tmp_path):
    # fp16 on CPU hardware: the pre-flight rule refuses every candidate.
    overrides = [
        "model=gpt_tiny",
        "hardware=cpu",
        "trainer.devices=2",
        "precision=bf16",
        "plan.search=true",
        "plan.search_space.precision=[fp16]",
        "plan.search_space.micro_batch=[1]",
    ]
    with pytest.raises(ConfigError, match="plan.search_space=.*pre-flight refuses every combination"):
        plan(compose_config(overrides, tmp_path, name="plan"))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.batch_size=2.5", "data.batch_size"),
        ("data.seq_len=512.9", "data.seq_len"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("data.seq_len=100000", "data.seq_len"),  # beyond model.max_seq_len
    ],
)
def test_plan_py_and_train_py_refuse_the_same_values(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        plan(compose_config([*BASE, override], tmp_path, name="plan"))
    with pytest.raises(ConfigError, match=key):
        validate_config(compose_config(["model=llama_7b", "precision=bf16", override], tmp_path, name="train"))


def test_a_fractional_node_count_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="trainer.num_nodes=1.5"):
        plan(compose_config([*BASE, "trainer.num_nodes=1.5"], tmp_path, name="plan"))


def test_machine_checks_do_not_apply_to_planned_hardware(tmp_path):
    # 64 CUDA devices and fp16 are refused by train.py on this CPU machine, but a plan is for other hardware.
    result = plan(
        compose_config([*BASE[:2], "trainer.devices=64", "+strategy=zero3", "precision=fp16"], tmp_path, name="plan")
    )
    assert result.estimate.inputs.world_size == 64


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("hardware.price_per_device_hour=-2", "hardware.price_per_device_hour"),
        ("hardware.price_per_device_hour=abc", "hardware.price_per_device_hour"),
        ("hardware.memory_gb=-1", "hardware.memory_gb"),
        ("hardware.host_memory_gb=-1", "hardware.host_memory_gb"),
        ("hardware.host_memory_gb=abc", "hardware.host_memory_gb"),
        ("hardware.peak_tflops={bf16:-1}", "hardware.peak_tflops.bf16"),
        ("hardware.peak_tflops=5", "hardware.peak_tflops"),
        ("hardware.pcie_gb_per_s=0", "hardware.pcie_gb_per_s"),
        ("hardware.pcie_gb_per_s=fast", "hardware.pcie_gb_per_s"),
        ("hardware.memory_gb_per_s=-1", "hardware.memory_gb_per_s"),
        ("hardware.nvme_gb_per_s=-8", "hardware.nvme_gb_per_s"),
        ("hardware.cpu_adam_params_per_s=0", "hardware.cpu_adam_params_per_s"),
        ("hardware.cpu_adam_params_per_s=true", "hardware.cpu_adam_params_per_s"),
        ("plan.hfu=abc", "plan.hfu"),
        ("plan.mfu=abc", "plan.mfu"),
        ("plan.target_tokens=abc", "plan.target_tokens"),
        ("plan.headroom_fraction=abc", "plan.headroom_fraction"),
        ("plan.search=maybe", "plan.search"),
    ],
)
def test_bad_hardware_and_plan_values_raise_our_config_error(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        plan_task(compose_config([*BASE, override], tmp_path, name="plan"))
