"""Every option of every config group composes, and every ``_target_`` binds to its target's signature."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from tests.helpers.compose import compose_config

CONF = Path(__file__).resolve().parents[3] / "conf"

# Groups that are not in the defaults list are appended with `+group=option`.
APPENDED = {"strategy"}
# Options that need a value the user must give (marked ??? in YAML).
NEEDS = {
    ("data", "text_file"): ["data.path=/etc/hostname"],
    ("strategy", "deepspeed_json"): ["strategy.config=DS_JSON"],
}
# Keys a builder consumes before instantiating (strategy presets carry their preset name).
CONSUMED = {"strategy": {"name"}}
SKIP_GROUPS = {"hydra"}


def _options() -> list[tuple[str, str]]:
    out = []
    for group_dir in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in SKIP_GROUPS):
        out.extend((group_dir.name, f.stem) for f in sorted(group_dir.glob("*.yaml")))
    return out


def _locate(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _target_errors(node: Any, where: str) -> list[str]:
    """Bind every ``_target_`` node below ``node`` to its callable's signature; return every failure."""
    errors: list[str] = []
    if isinstance(node, DictConfig):
        if "_target_" in node:
            kwargs = {k: v for k, v in node.items() if not str(k).startswith("_")}
            try:
                target = _locate(node._target_)
                sig = inspect.signature(target)
                (sig.bind_partial if node.get("_partial_", False) else sig.bind)(**kwargs)
            except Exception as err:  # collected, so that all errors are reported at once
                errors.append(f"{where}: {node._target_}: {type(err).__name__}: {err}")
        for key, value in node.items():
            errors.extend(_target_errors(value, f"{where}.{key}"))
    elif isinstance(node, ListConfig):
        for i, value in enumerate(node):
            errors.extend(_target_errors(value, f"{where}[{i}]"))
    return errors


def test_every_option_composes_and_binds(tmp_path):
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text('{"train_batch_size": 32, "zero_optimization": {"stage": 3}}')
    errors: list[str] = []
    options = _options()
    assert ("model", "llama_7b") in options
    for group, option in options:
        override = f"+{group}={option}" if group in APPENDED else f"{group}={option}"
        overrides = [override, *(o.replace("DS_JSON", str(ds_json)) for o in NEEDS.get((group, option), []))]
        try:
            cfg = compose_config(overrides, tmp_path)
            resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        except Exception as err:
            errors.append(f"{override}: does not compose: {type(err).__name__}: {err}")
            continue
        del resolved["hydra"]
        for key in CONSUMED.get(group, ()):
            if group in resolved:
                resolved[group].pop(key, None)
        errors.extend(_target_errors(resolved, override))
    assert not errors, "\n".join(errors)


def test_llama_presets_have_published_shapes(tmp_path):
    from hydra.utils import instantiate

    seven = instantiate(compose_config(["model=llama_7b"], tmp_path).model)
    assert (seven.n_layers, seven.d_model, seven.n_heads, seven.ffn_hidden, seven.vocab_size) == (
        32,
        4096,
        32,
        11008,
        32000,
    )
    assert seven.n_params() == pytest.approx(6.74e9, rel=0.002)
    thirteen = instantiate(compose_config(["model=llama_13b"], tmp_path).model)
    assert (thirteen.n_layers, thirteen.d_model, thirteen.n_heads, thirteen.ffn_hidden) == (40, 5120, 40, 13824)
    assert thirteen.n_params() == pytest.approx(13.0e9, rel=0.005)


def test_strategy_is_not_in_defaults(tmp_path):
    assert "strategy" not in compose_config([], tmp_path)


def test_optimizer_and_scheduler_are_partials(tmp_path):
    cfg = compose_config([], tmp_path)
    assert cfg.optimizer._partial_ is True
    assert cfg.scheduler._partial_ is True
    assert cfg.scheduler._target_.endswith("warmup_cosine")
