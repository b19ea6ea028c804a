"""With data=tokenized our model's vocabulary comes from the manifest unless the command line gives one."""

from __future__ import annotations

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from lightning_trainopt.config.data_vocab import apply_manifest_vocab
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.compose import compose_config
from tests.helpers.prepared import prepare_stdlib


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    return out, prepare_stdlib(out, vocab_size=300).vocab_size


def test_the_presets_vocabulary_becomes_the_manifests(tmp_path, shards):
    out, vocab = shards
    cfg = compose_config(["data=tokenized", f"data.path={out}"], tmp_path)
    assert cfg.model.vocab_size == 256
    assert apply_manifest_vocab(cfg) == vocab
    assert cfg.model.vocab_size == vocab > 256


def test_a_vocabulary_given_on_the_command_line_wins(tmp_path, shards):
    out, _ = shards
    cfg = compose_config(["data=tokenized", f"data.path={out}", "model.vocab_size=512"], tmp_path)
    HydraConfig.instance().set_config(cfg)
    assert list(HydraConfig.get().overrides.task)[-1] == "model.vocab_size=512"
    assert apply_manifest_vocab(cfg) is None
    assert cfg.model.vocab_size == 512


def test_other_data_and_other_models_are_left_alone(tmp_path, shards):
    out, _ = shards
    cfg = compose_config([], tmp_path)
    assert apply_manifest_vocab(cfg) is None
    cfg = OmegaConf.create(
        {"data": {"_target_": "lightning_trainopt.data.TokenizedDataModule", "path": str(out)},
         "model": {"_target_": "tests.helpers.user_module.UserLM", "vocab_size": 64}}
    )  # fmt: skip
    assert apply_manifest_vocab(cfg) is None
    assert cfg.model.vocab_size == 64


def test_a_path_without_a_manifest_is_refused_naming_data_path(tmp_path):
    cfg = compose_config(["data=tokenized", f"data.path={tmp_path}"], tmp_path)
    with pytest.raises(ConfigError, match="data.path"):
        apply_manifest_vocab(cfg)


def test_synthetic_data_takes_a_hugging_face_models_vocabulary_and_trains(tmp_path):
    # `model=hf ... data=synthetic` stopped with "data.vocab_size='${model.vocab_size}' is invalid": a Hugging Face
    # model's vocabulary is in its config.json (after overrides), not in the model node.
    from lightning_trainopt.config.data_vocab import apply_hf_synthetic_vocab
    from lightning_trainopt.launch.train import train
    from tests.helpers.hf_files import write_config

    write_config("llama", tmp_path / "llama")
    hf = ["model=hf", f"model.config={tmp_path / 'llama'}", "data=synthetic"]
    cfg = compose_config([*hf, "+model.overrides.vocab_size=200"], tmp_path)
    assert apply_hf_synthetic_vocab(cfg) == 200
    assert cfg.data.vocab_size == 200
    given = compose_config([*hf, "data.vocab_size=64"], tmp_path)
    assert apply_hf_synthetic_vocab(given) is None
    assert given.data.vocab_size == 64
    ours = compose_config(["data=synthetic"], tmp_path)
    assert apply_hf_synthetic_vocab(ours) is None
    assert ours.data.vocab_size == ours.model.vocab_size

    run = compose_config([*hf, "trainer.max_steps=2", "data.seq_len=16", "callbacks=none", "logger=none"], tmp_path)
    metrics = train(run)
    assert metrics["status"] == "ok"
    assert metrics["global_step"] == 2
