"""Nonsense values are refused before anything is built, with the key, the value and the fix."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.config.validate import validate_config
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.optim.schedules import resolve_warmup_steps
from tests.helpers.compose import compose_config


@pytest.mark.parametrize(
    ("override", "key", "fix_words"),
    [
        ("optimizer.lr=-0.001", "optimizer.lr", "positive learning rate"),
        ("optimizer.lr=0", "optimizer.lr", "positive learning rate"),
        ("trainer.max_steps=0", "trainer.max_steps", "positive number"),
        ("data.seq_len=100000", "data.seq_len", "model.max_seq_len=512"),
        ("scheduler.warmup_steps=300", "scheduler.warmup_steps", "raise trainer.max_steps"),
        ("trainer.devices=64", "trainer.devices", "trainer.devices<="),
        ("precision=fp16", "precision", "precision=bf16"),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches", "positive integer"),
        ("data.batch_size=0", "data.batch_size", "positive micro-batch"),
    ],
)
def test_bad_values_are_refused(tmp_path, override, key, fix_words):
    cfg = compose_config([override, "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == key
    value = override.split("=", 1)[1]
    assert value in str(err.value)
    assert fix_words in str(err.value)


def accepted_as_composed(cfg: DictConfig) -> None:
    """``validate_config`` accepts ``cfg`` and leaves every value as it was composed (it never adjusts input)."""
    before = OmegaConf.to_container(cfg)
    validate_config(cfg)
    assert OmegaConf.to_container(cfg) == before


def test_defaults_are_valid(tmp_path):
    cfg = compose_config([], tmp_path)
    accepted_as_composed(cfg)
    cfg.optimizer.lr = -1.0  # the same tree with one bad value: the check reads it
    with pytest.raises(ConfigError, match="optimizer.lr"):
        validate_config(cfg)


@pytest.mark.parametrize("path_kind", ["missing", "empty_file", "empty_dir"])
def test_text_file_path_is_checked(tmp_path, path_kind):
    from hydra.utils import instantiate

    target = tmp_path / "corpus"
    if path_kind == "empty_file":
        target.write_text("")
    elif path_kind == "empty_dir":
        target.mkdir()
    cfg = compose_config(["data=text_file", f"data.path={target}"], tmp_path)
    with pytest.raises(ConfigError) as err:
        instantiate(cfg.data).check_source()
    assert err.value.key == "data.path"
    assert str(target) in str(err.value)


@pytest.mark.parametrize(
    ("override", "key", "fix_words"),
    [
        # Caught only inside fit before: configure_optimizers, torch's optimizer, Lightning's fit loop.
        ("scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio", "between 0 and 1"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay", "number >= 0"),
        ("optimizer.betas=[0.9]", "optimizer.betas", "two numbers in [0, 1)"),
        ("optimizer.betas=[0.9, 1.0]", "optimizer.betas", "two numbers in [0, 1)"),
        ("optimizer.eps=-1.0", "optimizer.eps", ">= 0"),
        ("trainer.val_check_interval=0", "trainer.val_check_interval", "positive number of training batches"),
        ("trainer.val_check_interval=1.5", "trainer.val_check_interval", "fraction of an epoch in (0, 1]"),
        ("trainer.val_check_interval=0.5", "trainer.val_check_interval", "trainer.check_val_every_n_epoch=1"),
        ("trainer.val_check_interval=often", "trainer.val_check_interval", "'DD:HH:MM:SS'"),
        # Typos that crashed validate_config or a later step with a TypeError / ValueError.
        ("trainer.gradient_clip_val=abc", "trainer.gradient_clip_val", "positive norm"),
        ("seed=abc", "seed", "integer from 0 to 4294967295"),
        ("seed=-1", "seed", "integer from 0 to 4294967295"),
        ("hardware.price_per_device_hour=abc", "hardware.price_per_device_hour", "give a number; use dollars"),
        ("hardware.price_per_device_hour=-2.0", "hardware.price_per_device_hour", "number >= 0"),
        ("hardware.memory_gb=abc", "hardware.memory_gb", "positive size in GiB"),
        ("hardware.host_memory_gb=-2", "hardware.host_memory_gb", "RAM of one node in GiB"),
        ("model.max_seq_len=abc", "model.max_seq_len", "positive number of tokens"),
        ("data.val_fraction=abc", "data.val_fraction", "fraction between 0 and 1"),
        # Accepted as truthy before.
        ("compile=maybe", "compile", "true or false"),
        ("continue_on_oom=maybe", "continue_on_oom", "true or false"),
        # Blamed the wrong key, or advised a value that is refused itself.
        ("data.max_bytes=0", "data.max_bytes", "positive number of bytes"),
        ("optimizer.lr='3e-4'", "optimizer.lr", "give a number, not a string"),
    ],
)
def test_more_bad_values_are_refused_before_fit(tmp_path, override, key, fix_words):
    cfg = compose_config([override, "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == key
    assert override.split("=", 1)[1] in str(err.value)
    assert fix_words in str(err.value)


@pytest.mark.parametrize(
    ("name", "value", "fix_words"),
    [
        ("precision", "16-mixed", "precision=bf16"),
        ("strategy", "ddp", "+strategy=zero2"),
        ("callbacks", "[]", "callbacks=default"),
        ("logger", "false", "logger=csv"),
        ("plugins", "[]", "precision group"),
        ("default_root_dir", "/tmp/elsewhere", "hydra.run.dir"),
    ],
)
def test_trainer_arguments_the_app_sets_are_refused_naming_the_group(tmp_path, name, value, fix_words):
    cfg = compose_config([f"+trainer.{name}={value}", "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == f"trainer.{name}"
    assert "train.py sets this Trainer argument" in str(err.value)
    assert fix_words in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.val_check_interval=0.5", "trainer.check_val_every_n_epoch=1"],
        ["trainer.val_check_interval=00:00:01:00"],
        ["trainer.val_check_interval=null"],
        ["optimizer.betas=[0.0,0.999]", "optimizer.weight_decay=0", "trainer.gradient_clip_val=null"],
        ["seed=0", "compile=true", "continue_on_oom=false"],
        ["hardware.price_per_device_hour=2.5", "hardware.memory_gb=80", "+hardware.peak_tflops={bf16: 800}"],
        ["data.max_bytes=1000", "optimizer=lion8bit", "scheduler.min_lr_ratio=1.0"],
    ],
)
def test_good_variants_pass(tmp_path, overrides):
    cfg = compose_config([*overrides, "trainer.accelerator=cpu"], tmp_path)
    accepted_as_composed(cfg)


@pytest.mark.parametrize("ratio", [2, -0.5, "0.1"])
def test_the_schedule_and_the_validator_refuse_the_same_min_lr_ratio(tmp_path, ratio):
    import torch

    from lightning_trainopt.models.lit_gpt import warmup_cosine

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError) as from_schedule:
        warmup_cosine(optimizer, warmup_steps=1, total_steps=300, min_lr_ratio=ratio)
    value = f"'{ratio}'" if isinstance(ratio, str) else ratio
    cfg = compose_config([f"scheduler.min_lr_ratio={value}", "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigError) as from_validate:
        validate_config(cfg)
    assert str(from_validate.value) == str(from_schedule.value)


def test_gpu_accelerator_without_cuda_advises_cpu_not_zero_devices(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cfg = compose_config(["trainer.accelerator=gpu"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == "trainer.accelerator"
    assert "trainer.accelerator=cpu" in str(err.value)
    assert "devices<=0" not in str(err.value)


def test_text_file_without_path_names_data_path(tmp_path):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = compose_config(["data=text_file", "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == "data.path"
    assert "data.path=/path/to/file_or_folder" in str(err.value)
    # The data module says the same when built (no MissingMandatoryValue from a `???` in the preset); Hydra wraps
    # it, and the CLI unwraps it (tests/unit/config/test_cli.py).
    with pytest.raises(InstantiationException) as from_module:
        instantiate(cfg.data)
    assert isinstance(from_module.value.__cause__, ConfigError)
    assert from_module.value.__cause__.key == "data.path"


def test_a_warmup_cosine_callback_longer_than_the_run_is_refused_before_fit(tmp_path):
    # The callback checks itself at fit start; train.py now checks it with the other keys, before anything is built.
    cfg = compose_config(
        [
            "callbacks=[default,warmup_cosine_lr]",
            "trainer.max_steps=20",
            "callbacks.warmup_cosine_lr.warmup_steps=30",
            "trainer.accelerator=cpu",
        ],
        tmp_path,
    )
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == "callbacks.warmup_cosine_lr.warmup_steps"
    ok = compose_config(
        [
            "callbacks=[default,warmup_cosine_lr]",
            "trainer.max_steps=20",
            "callbacks.warmup_cosine_lr.warmup_steps=5",
            "trainer.accelerator=cpu",
        ],
        tmp_path,
    )
    validate_config(ok)


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
@pytest.mark.parametrize("trainer", ["default", "ddp_sim"])
def test_every_default_fits_a_smoke_run(tmp_path, steps, trainer):
    # The user types only the run's length: no default may refuse it (the default warmup is a fraction of the run).
    cfg = compose_config(
        [f"trainer={trainer}", f"trainer.max_steps={steps}", "callbacks=[default,warmup_cosine_lr,non_finite_guard]"],
        tmp_path,
    )
    accepted_as_composed(cfg)
    # The warmups the run will use (the scheduler's and the callback's, each a fraction of the run) are shorter than it.
    for node in (cfg.scheduler, cfg.callbacks.warmup_cosine_lr):
        assert 0 <= resolve_warmup_steps(node.warmup_steps, node.warmup_ratio, steps) < steps
    cfg.scheduler.warmup_steps = steps  # a warmup as long as the run is refused: the check sees the run's length
    with pytest.raises(ConfigError, match="scheduler.warmup_steps"):
        validate_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "key", "fix_words"),
    [
        (["scheduler.warmup_ratio=1.0"], "scheduler.warmup_ratio", "[0, 1)"),
        (["scheduler.warmup_ratio=-0.1"], "scheduler.warmup_ratio", "[0, 1)"),
        (["scheduler.warmup_steps=3", "scheduler.warmup_ratio=0.1"], "scheduler.warmup_ratio", "warmup_steps=3"),
        (["trainer.max_steps=3", "scheduler.warmup_steps=3"], "scheduler.warmup_steps", "3 optimizer steps"),
        (
            ["callbacks=[default,warmup_cosine_lr]", "callbacks.warmup_cosine_lr.warmup_ratio=1.5"],
            "callbacks.warmup_cosine_lr.warmup_ratio",
            "[0, 1)",
        ),
        (
            [
                "callbacks=[default,warmup_cosine_lr]",
                "callbacks.warmup_cosine_lr.warmup_steps=2",
                "callbacks.warmup_cosine_lr.warmup_ratio=0.1",
            ],
            "callbacks.warmup_cosine_lr.warmup_ratio",
            "callbacks.warmup_cosine_lr.warmup_steps=2",
        ),
    ],
)
def test_bad_warmups_are_refused(tmp_path, overrides, key, fix_words):
    cfg = compose_config([*overrides, "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == key
    assert fix_words in str(err.value)


def test_explicit_warmup_steps_win_over_the_default_ratio(tmp_path):
    import torch

    from lightning_trainopt.models.lit_gpt import warmup_cosine

    validate_config(compose_config(["scheduler.warmup_steps=4", "trainer.max_steps=5"], tmp_path))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    explicit = warmup_cosine(optimizer, total_steps=5, warmup_steps=4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25)  # step 0 of a 4-step warmup
    assert explicit.lr_lambdas[0](3) == pytest.approx(1.0)
    by_ratio = warmup_cosine(optimizer, total_steps=300)
    assert by_ratio.lr_lambdas[0](0) == pytest.approx(0.1)  # step 0 of the default 10-step warmup
    assert by_ratio.lr_lambdas[0](9) == pytest.approx(1.0)
    short = warmup_cosine(optimizer, total_steps=1)
    assert short.lr_lambdas[0](0) == pytest.approx(1.0)  # a 1-step run starts at the peak
