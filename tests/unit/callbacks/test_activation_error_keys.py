"""The key an activation callback's error names is the Hydra key a user overrides to fix it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from lightning_trainopt.exceptions import ConfigError
from tests.helpers.compose import compose_config


def _build(node: object) -> object:
    # Called directly rather than through hydra.utils.instantiate, which wraps the error in its own exception.
    kwargs = OmegaConf.to_container(node)
    assert isinstance(kwargs, dict)
    return get_class(kwargs.pop("_target_"))(**kwargs)


@pytest.mark.parametrize(
    ("preset", "argument", "bad"),
    [
        ("checkpoint", "every_k", 0),
        ("checkpoint_every_2nd", "every_k", -1),
        ("int8", "bits", 4),
        ("int8", "block_size", 0),
        ("offload", "min_numel", 0),
    ],
)
def test_error_key_is_an_overridable_hydra_key(tmp_path: Path, preset: str, argument: str, bad: int) -> None:
    cfg = compose_config([f"activations={preset}"], tmp_path)
    (node,) = cfg.activations.keys()
    with pytest.raises(ConfigError) as err:
        _build(OmegaConf.merge(cfg.activations[node], {argument: bad}))
    key = re.search(r"(activations\.[\w.]+)", str(err.value))
    assert key is not None, str(err.value)
    assert key.group(1) == f"activations.{node}.{argument}"
    # The named key exists in the composed tree: overriding it on the command line composes, and the bad value
    # given there fails with the same key.
    overridden = compose_config([f"activations={preset}", f"{key.group(1)}={bad}"], tmp_path)
    assert OmegaConf.select(overridden, key.group(1)) == bad
    with pytest.raises(ConfigError, match=re.escape(key.group(1))):
        _build(overridden.activations[node])
