"""TrainOptFSDPStrategy shards any LightningModule, with or without ``configure_model``, by its repeated block."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT
from lightning_trainopt.parallel import TrainOptFSDPStrategy
from lightning_trainopt.parallel.fsdp import block_classes
from tests.helpers.tiny_fit import TINY, tiny_trainer
from tests.unit.callbacks._foreign import DictClassifier, loader, padded_batches


def test_the_repeated_block_is_found_in_any_model():
    assert block_classes(GPT(TINY)) == ["Block"]
    assert block_classes(DictClassifier()) == ["TransformerEncoderLayer"]  # nn.TransformerEncoder's layers
    assert block_classes(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []  # no list of blocks


def test_a_hugging_face_model_names_its_block():
    pytest.importorskip("transformers")
    from tests.helpers.hf import hf_module

    assert block_classes(hf_module("llama")) == ["LlamaDecoderLayer"]  # its _no_split_modules
    assert block_classes(hf_module("gpt2")) == ["GPT2Block"]


def _sharded(module, batches, **kwargs):
    from torch.distributed.fsdp import FSDPModule

    trainer = tiny_trainer([], max_steps=2, strategy=TrainOptFSDPStrategy(**kwargs))
    trainer.fit(module, loader(batches))
    assert trainer.global_step == 2
    return [type(m).__mro__[2].__name__ for m in module.modules() if isinstance(m, FSDPModule)]


def test_a_plain_module_without_configure_model_is_sharded_by_its_block():
    # Lightning's ModelParallelStrategy refuses a LightningModule without configure_model.
    module = DictClassifier()
    assert "configure_model" not in vars(type(module))
    units = _sharded(module, padded_batches(2))
    # the two encoder layers, then each parameter-holding child of the LightningModule
    assert units == ["Embedding", "TransformerEncoder", "TransformerEncoderLayer", "TransformerEncoderLayer", "Linear"]
    assert "configure_model" not in vars(module)  # the check's stand-in is gone after setup


def test_a_hugging_face_module_is_sharded_by_its_decoder_layers():
    pytest.importorskip("transformers")
    from tests.helpers.hf import hf_batches, hf_module

    units = _sharded(hf_module("llama"), hf_batches(2))
    assert units == ["LlamaForCausalLM", "LlamaDecoderLayer", "LlamaDecoderLayer"]


def test_shard_modules_that_match_nothing_are_refused_with_the_block_found():
    with pytest.raises(ConfigError, match=r"strategy.shard_modules=\['Block'\].*TransformerEncoderLayer"):
        _sharded(DictClassifier(), padded_batches(2), shard_modules=["Block"])
