"""Issue #20: a real train(cfg) hands no DictConfig/ListConfig to anything below config/ (ours or a library's)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf, open_dict

from lightning_trainopt.launch.train import train
from lightning_trainopt.models.optimization import configure_optimizers
from tests.helpers.compose import TINY, compose_config
from tests.helpers.dictconfig_guard import no_config_below_config
from tests.helpers.hf_files import write_config

HF = ["model=hf", "+model.overrides.num_hidden_layers=1", "activations=int8", "callbacks=none"]


def test_the_guard_sees_a_config_node_passed_below_config():
    # The guard itself can fail: a ListConfig given to a models/ function is seen.
    with no_config_below_config() as guard, pytest.raises(AttributeError):
        configure_optimizers(None, OmegaConf.create([1]), None)  # type: ignore[arg-type]
    assert [(leak.function.rsplit(".", 1)[-1], leak.argument) for leak in guard.leaks] == [
        ("configure_optimizers", "optimizer")
    ]


def test_a_short_train_and_its_resume_pass_no_config_node_below_config(tmp_path):
    # Our GPT, the default callbacks (checkpoint and monitors), an activation preset, the CSV logger, AdamW's betas
    # list and the scheduler; then the same command resumed from the finished run (the checkpoint/ checks).
    cfg = compose_config([*TINY, "trainer.max_steps=2", "activations=checkpoint", "logger=csv"], tmp_path)
    with no_config_below_config() as guard:
        metrics = train(cfg)
        with open_dict(cfg):
            cfg.ckpt_path = "last"
        resumed = train(cfg)
    assert metrics["status"] == "ok"
    assert metrics["global_step"] == 2
    assert resumed == json.loads((tmp_path / "metrics.json").read_text()) == json.loads(json.dumps(metrics))
    assert guard.calls_checked > 1000  # the hook really watched the run
    assert not guard.leaks, "config nodes below config/:\n" + "\n".join(map(str, guard.leaks))


def test_a_hugging_face_model_passes_no_config_node_below_config(tmp_path):
    pytest.importorskip("transformers")
    file = write_config("gpt2", tmp_path / "gpt2")
    base = [o for o in TINY if not o.startswith("model.")]
    cfg = compose_config([*base, "trainer.max_steps=2", *HF, f"model.config={file}"], tmp_path)
    with no_config_below_config() as guard:
        metrics = train(cfg)
    assert metrics["status"] == "ok"
    assert metrics["model"] == "gpt2"
    assert not guard.leaks, "config nodes below config/:\n" + "\n".join(map(str, guard.leaks))
