"""Nonsense values are refused before anything is built, with the key, the value and the fix."""

from __future__ import annotations

import pytest

from lightning_trainopt.app.validate import validate_config
from lightning_trainopt.exceptions import ConfigError
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


def test_defaults_are_valid(tmp_path):
    validate_config(compose_config([], tmp_path))


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
