"""Our GPT with a chosen attention kernel, attention inside packed documents, and its hidden states for a head loss."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.transforms.attention import document_ids

SHAPE = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 172}


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**SHAPE, **kw))


def test_each_packed_document_is_modelled_as_if_alone():
    model = _gpt()
    x = torch.randint(1, 256, (2, 16))
    x[:, 5] = 0  # EOS: positions 0-5 are one document, 6-15 the next
    packed = model(x, doc_ids=document_ids(x, eos_id=0))
    assert torch.allclose(packed[:, :6], model(x[:, :6]), atol=1e-5)
    assert torch.allclose(packed[:, 6:], model(x[:, 6:]), atol=1e-5)  # RoPE is relative: the offset does not matter
    assert not torch.allclose(packed[:, 6:], model(x)[:, 6:], atol=1e-3)  # without the mask they see doc 1


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_a_chosen_cpu_kernel_gives_the_default_kernels_logits(kernel):
    x = torch.randint(0, 256, (2, 16))
    assert torch.allclose(_gpt(attention=kernel)(x), _gpt()(x), atol=1e-5)


def test_the_hidden_states_are_what_the_head_takes():
    model = _gpt()
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(model.lm_head(model(x, return_hidden=True)), model(x))


def test_an_unknown_kernel_names_the_key():
    with pytest.raises(ConfigError, match="model.attention"):
        GPTConfig(**SHAPE, attention="flash2")


@pytest.mark.parametrize("kernel", ["efficient", "cudnn", "flash_attn"])
def test_a_cuda_kernel_is_refused_before_training_on_a_cpu(tmp_path, kernel):
    from lightning_trainopt.config.validate import validate_config
    from tests.helpers.compose import compose_config

    cfg = compose_config([f"model.attention={kernel}", "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == "model.attention"
    # A plan for GPU hardware is not refused here.
    from lightning_trainopt.config.plan import plan

    assert plan(compose_config([f"model.attention={kernel}", "hardware=h100"], tmp_path, name="plan")).estimate
