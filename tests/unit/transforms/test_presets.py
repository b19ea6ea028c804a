"""Every conf/activations and conf/optimizer preset composes and instantiates into what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from tests.helpers.compose import REPO_ROOT, compose_config

ACTIVATIONS = {
    "none": {},
    "checkpoint": {"activation_checkpointing": ("ActivationCheckpointing", {"every_k": 1})},
    "checkpoint_every_2nd": {"activation_checkpointing": ("ActivationCheckpointing", {"every_k": 2})},
    "offload": {"activation_offload": ("ActivationOffload", {"pin_memory": True})},
    "int8": {"activation_compression": ("ActivationCompression", {"bits": 8, "block_size": 64})},
}


def test_every_activation_preset_is_covered() -> None:
    assert {p.stem for p in (REPO_ROOT / "lightning_trainopt" / "conf" / "activations").glob("*.yaml")} == set(
        ACTIVATIONS
    )


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_preset(name: str, tmp_path: Path) -> None:
    cfg = compose_config([f"activations={name}"], output_dir=tmp_path)
    built = {key: instantiate(node) for key, node in cfg.activations.items()}
    assert {k: type(v).__name__ for k, v in built.items()} == {k: v[0] for k, v in ACTIVATIONS[name].items()}
    for key, (_, attrs) in ACTIVATIONS[name].items():
        obj = built[key]
        for attr, value in attrs.items():
            got = obj.policy.every_k if attr == "every_k" else getattr(obj, attr)
            assert got == value
        assert callable(getattr(obj, "summary", None))


OPTIMIZERS = {
    "adamw": ("AdamW", None),
    "adamw8bit": ("AdamW8bit", "bnb"),
    "adam8bit": ("Adam8bit", "bnb"),
    "paged_adamw8bit": ("PagedAdamW8bit", "bnb"),
    "lion8bit": ("Lion8bit", "bnb"),
    "adamw8bit_torchao": ("AdamW8bit", "torchao"),
    "adamw4bit_torchao": ("AdamW4bit", "torchao"),
}


def test_every_optimizer_preset_is_covered() -> None:
    assert {p.stem for p in (REPO_ROOT / "lightning_trainopt" / "conf" / "optimizer").glob("*.yaml")} == set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_preset(name: str, tmp_path: Path) -> None:
    cls, needs = OPTIMIZERS[name]
    if needs is not None:
        pytest.importorskip("bitsandbytes" if needs == "bnb" else "torchao")
    cfg = compose_config([f"optimizer={name}"], output_dir=tmp_path)
    assert cfg.optimizer._partial_ is True
    params = [torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(64))]
    optimizer = instantiate(cfg.optimizer)([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}])
    assert type(optimizer).__name__ == cls
    assert optimizer.param_groups[0]["lr"] == cfg.optimizer.lr
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
