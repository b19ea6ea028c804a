"""The three kinds of model train.py builds: our GPT presets, model=hf, model=module (any LightningModule)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_trainopt.config.model_factory import (
    build_lightning_module,
    count_params,
    meta_module,
    model_kind,
    model_name,
    model_vocab_size,
)
from lightning_trainopt.config.rewrite import install_app_rewrites
from lightning_trainopt.config.validate import validate_config
from lightning_trainopt.exceptions import ConfigError, ConfigKeysError
from lightning_trainopt.models import LitCausalLM, LitGPT
from tests.helpers.compose import compose_config
from tests.helpers.user_module import UserLM

USER = "tests.helpers.user_module"
MODULE = ("model=module", f"model._target_={USER}.UserLM", "trainer.accelerator=cpu")


def _attach(module, max_steps: int = 10):
    module._trainer = SimpleNamespace(
        estimated_stepping_batches=max_steps, precision="32-true", gradient_clip_val=None, strategy=None
    )
    return module


def test_gpt_presets_stay_the_default(tmp_path):
    cfg = compose_config([], tmp_path)
    module = build_lightning_module(cfg)
    assert model_kind(cfg.model) == "gpt"
    assert isinstance(module, LitGPT)
    assert model_name(cfg.model.name, module) == "gpt_tiny"
    assert count_params(meta_module(cfg)) == module.config.n_params()


def test_a_user_module_without_configure_optimizers_gets_the_groups(tmp_path):
    cfg = compose_config([*MODULE, "+model.d_model=16", "optimizer.lr=0.01", "scheduler.warmup_steps=2"], tmp_path)
    module = _attach(build_lightning_module(cfg))
    assert type(module) is UserLM
    assert module.embed.embedding_dim == 16
    out = module.configure_optimizers()
    optimizer = out["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005)  # the schedule: step 1 of 2 warmup steps
    assert optimizer.defaults["lr"] == 0.01
    # Weight decay on matrices only, every parameter once.
    assert {p.dim() for p in optimizer.param_groups[1]["params"]} == {1}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(module.parameters()))
    assert out["lr_scheduler"]["interval"] == "step"


def test_a_user_module_with_configure_optimizers_keeps_it(tmp_path):
    cfg = compose_config(
        ["model=module", f"model._target_={USER}.UserLMWithOptimizer", "+model.lr=0.5", "optimizer.lr=0.01"], tmp_path
    )
    module = _attach(build_lightning_module(cfg))
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["lr"] == 0.5


def test_metrics_name_and_count_of_each_kind(tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers.hf_files import write_config

    file = write_config("gpt2", tmp_path / "gpt2")
    hf_cfg = compose_config(["model=hf", f"model.config={file}"], tmp_path)
    hf = build_lightning_module(hf_cfg)
    assert isinstance(hf, LitCausalLM)
    assert model_vocab_size(hf) == 256
    hf.configure_model()
    # GPT-2 ties lm_head to the embedding: counted once.
    assert count_params(hf) == sum(p.numel() for p in hf.model.parameters()) == count_params(meta_module(hf_cfg))
    assert model_name(None, hf) == "gpt2"
    user_cfg = compose_config(MODULE, tmp_path)
    user = build_lightning_module(user_cfg)
    assert model_name(None, user) == "UserLM"
    assert count_params(user) == sum(p.numel() for p in user.parameters()) > 0
    assert model_vocab_size(user) == 256


def test_zero3_placeholders_count_their_true_size():
    module = torch.nn.Linear(4, 3)
    for p in module.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert count_params(module) == 15


def test_meta_module_builds_every_kind_without_memory(tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers.hf_files import write_config

    file = write_config("llama", tmp_path / "llama")
    for overrides in ([], ["model=hf", f"model.config={file}", "compile=true"], list(MODULE)):
        module = meta_module(compose_config(overrides, tmp_path))
        devices = {p.device.type for p in module.parameters()}
        assert devices == {"meta"}, overrides


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["model=module"], "model._target_", "model._target_=pkg.module.MyModule"),
        (["model=module", "model._target_=torch.nn.Linear"], "model._target_", "LightningModule class"),
        (["data=datamodule"], "data._target_", "data._target_=pkg.module.MyData"),
    ],
)
def test_user_targets_are_refused_with_the_fix(tmp_path, overrides, key, words):
    with pytest.raises(ConfigError, match=r"is invalid") as err:
        validate_config(compose_config([*overrides, "trainer.accelerator=cpu"], tmp_path))
    assert err.value.key == key
    assert words in err.value.fix


def test_user_module_keys_are_bound_to_its_signature(tmp_path):
    cfg = compose_config([*MODULE, "+model.d_modle=16"], tmp_path)
    with pytest.raises(ConfigKeysError, match=f"unknown argument of {USER}.UserLM; did you mean d_model"):
        validate_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["model.config=meta-llama/Llama-2-7b-hf"], "model.config", "never downloads"),
        (["+model.overrides.num_layers=1"], "model.overrides.num_layers", "not a field of LlamaConfig"),
        (["+model.overrides.vocab_size=100"], "model.overrides.vocab_size", "at least 256"),
        (["model.attn_implementation=flash_attention_2"], "model.attn_implementation", ".[gpu]"),
        (["data.seq_len=256"], "data.seq_len", "128 positions"),
        (["data=synthetic"], "data.vocab_size", "give data.vocab_size=N"),
    ],
)
def test_hf_models_are_refused_before_anything_starts(tmp_path, overrides, key, words):
    pytest.importorskip("transformers")
    from tests.helpers.hf_files import write_config

    file = write_config("llama", tmp_path / "llama")
    cfg = compose_config(["model=hf", f"model.config={file}", "trainer.accelerator=cpu", *overrides], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == key
    assert words in err.value.fix


def test_hf_model_with_synthetic_data_of_its_vocabulary_passes(tmp_path):
    pytest.importorskip("transformers")
    from lightning_trainopt.config.build import data_vocab_size
    from tests.helpers.hf_files import write_config

    file = write_config("llama", tmp_path / "llama", vocab_size=512)
    base = ["model=hf", f"model.config={file}", "data=synthetic", "trainer.accelerator=cpu"]
    cfg = compose_config([*base, "data.vocab_size=512"], tmp_path)
    validate_config(cfg)
    # What train() then compares: the model embeds 512 ids, the data draws from 512.
    assert model_vocab_size(meta_module(cfg)) == data_vocab_size(instantiate(cfg.data)) == 512
    with pytest.raises(ConfigError, match="token ids up to 1023"):  # more ids than the model embeds
        validate_config(compose_config([*base, "data.vocab_size=1024"], tmp_path))


def test_compile_compiles_a_user_module_s_blocks_in_place(tmp_path):
    module = build_lightning_module(compose_config([*MODULE, "compile=true"], tmp_path))
    names = [name for name, _ in module.named_parameters()]
    # As train.py does it: compile=true is the model rewrite's step at the end of configure_model.
    install_app_rewrites(module, [], compile_model=True)
    module.configure_model()
    # Its repeated block is compiled in place, one block at a time (a module without one: each parameter-holding
    # child); names and class are kept.
    compiled = [name for name, child in module.named_modules() if getattr(child, "_compiled_call_impl", None)]
    assert compiled == ["blocks.0", "blocks.1"]
    assert type(module) is UserLM
    assert [name for name, _ in module.named_parameters()] == names


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_pretrained_weights_pass_the_checks_under_every_zero_stage(tmp_path, strategy):
    # Under ZeRO-3 they are loaded one gathered parameter at a time and kept (tests/unit/models/test_hf.py).
    pytest.importorskip("transformers")
    from tests.helpers.hf_files import write_pretrained

    write_pretrained("llama", tmp_path / "weights")
    overrides = ["model=hf", f"model.pretrained={tmp_path / 'weights'}", "trainer.accelerator=cpu"]
    cfg = compose_config([*overrides, f"+strategy={strategy}"], tmp_path)
    before = OmegaConf.to_container(cfg)
    validate_config(cfg)
    assert OmegaConf.to_container(cfg) == before  # taken as given under every stage
    spec = instantiate(cfg.model)
    assert spec.weights_dir() == tmp_path / "weights"  # where the weights load from, its check passed
    (tmp_path / "weights" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="holds no weights"):  # ... a check that reads the directory
        spec.weights_dir()


def test_a_module_whose_vocabulary_the_data_outgrows_is_refused_before_training(tmp_path):
    from lightning_trainopt.launch.train import train

    cfg = compose_config([*MODULE, "+model.vocab_size=100", "logger=none"], tmp_path)
    with pytest.raises(ConfigError, match="token ids up to 255") as err:
        train(cfg)
    assert err.value.key == "model.vocab_size"
    assert err.value.value == 100
    assert not (tmp_path / "metrics.json").exists()


def test_qlora_counts_each_4bit_weight_once_not_its_packed_storage():
    # A QLoRA base packs 4 weights into each bf16 element: metrics.json's n_params (and the summary's "parameters")
    # read 72,000 for a 2-layer d_model=64 gpt_tiny whose base plus adapters hold 133,440 (found by review).
    pytest.importorskip("bitsandbytes")
    from lightning_trainopt.transforms.adapters import AdapterSpec, apply_adapter

    overrides = ["model.n_layers=2", "model.d_model=64", "model.ffn_hidden=128"]
    lora, qlora = (build_lightning_module(compose_config(overrides)) for _ in range(2))
    for module, kind in ((lora, "lora"), (qlora, "qlora")):
        module.configure_model()
        apply_adapter(module, AdapterSpec(kind=kind))
    assert count_params(qlora) == count_params(lora) == module.config.n_params() + 34_816  # r=16 on 14 layers
