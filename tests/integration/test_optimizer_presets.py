"""Every optimizer preset in conf/optimizer trains two steps through train(cfg) and reports its state bytes."""

from __future__ import annotations

import json
import math

import pytest

from lightning_trainopt.launch.train import train
from tests.helpers.compose import REPO_ROOT, TINY, compose_config
from tests.helpers.runif import RunIf

PRESETS = sorted(p.stem for p in (REPO_ROOT / "lightning_trainopt" / "conf" / "optimizer").glob("*.yaml"))
_NEEDS = {"bitsandbytes": RunIf(bnb=True), "torchao": RunIf(torchao=True)}


def _package(preset: str) -> str | None:
    target = (REPO_ROOT / "lightning_trainopt" / "conf" / "optimizer" / f"{preset}.yaml").read_text()
    if "torchao" in target:
        return "torchao"
    if ".bnb_" in target or "bitsandbytes" in target:
        return "bitsandbytes"
    return None


def _param(preset: str) -> object:
    package = _package(preset)
    return pytest.param(preset, marks=[_NEEDS[package]] if package else [], id=preset)


def test_every_preset_is_listed():
    # A preset added later is picked up by the glob; this guards against the glob finding nothing.
    assert {"adamw", "adamw8bit", "adamw4bit_torchao", "adamw8bit_torchao"} <= set(PRESETS)


@pytest.mark.parametrize("preset", [_param(p) for p in PRESETS])
def test_preset_trains_two_steps_and_reports_state_bytes(tmp_path, preset):
    overrides = [
        *TINY,
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "data=synthetic",
        "data.synthetic_tokens=20000",
        f"optimizer={preset}",
        "callbacks=memory_breakdown",
    ]
    metrics = train(compose_config(overrides, tmp_path))
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk["global_step"] == 2
    assert math.isfinite(metrics["train_loss"])
    states = on_disk["memory_breakdown"]["optimizer_states"]
    n_params = on_disk["n_params"]
    # Every preset keeps some state, and none more than fp32 AdamW's two moments (8 B/param) plus step counters.
    assert 0 < states["device"] + states["cpu"] <= 8 * n_params + 4096
