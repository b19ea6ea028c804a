"""An adapter run's checkpoint: the adapters without the frozen base, checked against the rebuilt base on resume."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.checkpoint.adapter_state import (
    ADAPTER_KEY,
    install_adapter_checkpointing,
    restore_frozen_base,
    restore_rng,
    strip_frozen_base,
)
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPTConfig, LitGPT
from lightning_trainopt.transforms.adapters import AdapterSpec, adapter_state_dict, apply_adapter

SPEC = AdapterSpec(kind="lora", r=4)


def _module(seed: int = 0) -> LitGPT:
    torch.manual_seed(seed)
    module = LitGPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=64))
    module.configure_model()
    apply_adapter(module, SPEC)
    return module


def test_the_checkpoint_holds_only_the_adapters_and_how_to_rebuild_the_base():
    module = _module()
    checkpoint = {"state_dict": module.state_dict()}
    strip_frozen_base(module, checkpoint, SPEC)
    assert set(checkpoint["state_dict"]) == set(adapter_state_dict(module))
    record = checkpoint[ADAPTER_KEY]
    assert record["spec"]["r"] == 4
    assert record["rebuild"]["model"]["d_model"] == 64
    assert record["base_tensors_left_out"] == len(module.state_dict()) - len(checkpoint["state_dict"])
    assert torch.equal(record["rng"]["torch"], torch.get_rng_state())
    restore_frozen_base(_module(), checkpoint)  # the same seed rebuilds the same base: accepted


def test_another_base_or_missing_adapter_tensors_are_refused_naming_ckpt_path():
    module = _module()
    checkpoint = {"state_dict": module.state_dict()}
    strip_frozen_base(module, checkpoint, SPEC)
    with pytest.raises(ConfigError, match="another frozen base") as err:
        restore_frozen_base(_module(seed=1), checkpoint)
    assert err.value.key == "ckpt_path"
    checkpoint["state_dict"].pop(next(iter(checkpoint["state_dict"])))
    with pytest.raises(ConfigError, match="lacks 1 adapter tensors"):
        restore_frozen_base(_module(), checkpoint)


def test_the_hooks_strip_on_save_check_on_load_and_restore_the_rng_at_the_first_batch():
    module = _module()
    install_adapter_checkpointing(module, SPEC)
    assert module.strict_loading is False
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    expected = torch.rand(3)  # the draws the uninterrupted run makes after the checkpoint
    torch.manual_seed(123)
    module.on_load_checkpoint(checkpoint)
    torch.rand(5)  # e.g. a data loader drawing its seed before the first batch
    module.on_train_batch_start(None, 0)
    assert torch.equal(torch.rand(3), expected)
    restore_rng(module)  # once only
