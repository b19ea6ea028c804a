"""A loss that applies the output head itself (loss=chunked_ce) trains our GPT and a Hugging Face model exactly as
the logits + cross-entropy do; document attention in LitGPT."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPTConfig, HFModelConfig, LitCausalLM, LitGPT
from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss
from tests.helpers.compose import compose_config

SHAPE = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=172, vocab_size=256, max_seq_len=64)


def _loss_and_grads(module, batch):
    module.configure_model()
    loss, tokens = module.batch_loss(batch)
    grads = torch.autograd.grad(loss, [p for p in module.parameters() if p.requires_grad])
    return loss, tokens, grads


def _same(a, b):
    (la, ta, ga), (lb, tb, gb) = a, b
    assert torch.allclose(la, lb, atol=1e-5)
    assert int(ta) == int(tb)
    for x, y in zip(ga, gb, strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)


def test_lit_gpt_with_the_chunked_loss_equals_the_standard_loss():
    batch = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    torch.manual_seed(0)
    plain = _loss_and_grads(LitGPT(SHAPE), batch)
    torch.manual_seed(0)
    _same(_loss_and_grads(LitGPT(SHAPE, loss=ChunkedLMHeadLoss(chunk_tokens=7)), batch), plain)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_lit_causal_lm_with_the_chunked_loss_equals_the_models_own_loss(kind, tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers.hf_files import write_config

    write_config(kind, tmp_path / kind)
    spec = HFModelConfig(config=str(tmp_path / kind))
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    for batch in ((ids, torch.randint(0, 64, (2, 12))), {"input_ids": ids, "attention_mask": mask}):
        torch.manual_seed(0)
        plain = _loss_and_grads(LitCausalLM(spec), batch)
        torch.manual_seed(0)
        _same(_loss_and_grads(LitCausalLM(spec, loss=ChunkedLMHeadLoss(chunk_tokens=5)), batch), plain)


def test_a_users_module_with_a_head_loss_is_refused_naming_the_key(tmp_path):
    from lightning_trainopt.config.model_factory import build_lightning_module

    cfg = compose_config(["model=module", "model._target_=tests.helpers.user_module.UserLM", "loss=chunked_ce"])
    with pytest.raises(ConfigError, match="use loss=standard") as err:
        build_lightning_module(cfg)
    assert err.value.key == "loss"


def test_document_attention_masks_at_the_eos_id():
    torch.manual_seed(0)
    module = LitGPT(SHAPE)
    module.configure_model()
    x = torch.randint(1, 256, (2, 16))
    x[:, 7] = 0
    batch = (x, torch.randint(0, 256, (2, 16)))
    plain, _ = module.batch_loss(batch)
    module.document_eos = 0
    masked, _ = module.batch_loss(batch)
    assert not torch.allclose(plain, masked)
    # The second document's positions score as if it were alone.
    tail = module.gpt(x[:, 8:])
    assert torch.allclose(module(x, doc_ids=torch.tensor([[0] * 8 + [1] * 8] * 2))[:, 8:], tail, atol=1e-5)


def test_a_head_loss_with_compile_passes_validation_under_every_sharding(tmp_path):
    # compile=true compiles the blocks and leaves the head eager, so the head loss runs inside the model's forward
    # (and FSDP2's unit); tests/integration/test_app_rewrite.py trains it on 2 processes.
    from lightning_trainopt.config.validate import validate_config

    base = ["loss=chunked_ce", "compile=true", "trainer.accelerator=cpu"]
    for strategy in ("zero3", "fsdp"):
        validate_config(compose_config([*base, f"+strategy={strategy}"], tmp_path))
