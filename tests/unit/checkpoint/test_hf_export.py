"""Our GPT as a Hugging Face Llama directory: the same logits after from_pretrained."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.checkpoint.hf_export import gpt_to_llama
from lightning_trainopt.models import GPT, GPTConfig


@pytest.mark.parametrize(
    "shape",
    [
        GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=32),
        # Grouped-query attention, untied head, another rotary base.
        GPTConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, tie_embeddings=False, rope_theta=5e5),
    ],
    ids=["tied", "gqa-untied-theta"],
)
def test_a_gpt_saved_as_llama_loads_back_with_the_same_logits(shape, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    gpt = GPT(shape).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() == 1:  # norms away from their initial ones, so a misplaced norm weight shows
                p.add_(torch.randn_like(p) * 0.1)
    gpt_to_llama(gpt.state_dict(), shape, tmp_path)
    llama = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert llama.config.rope_parameters["rope_theta"] == shape.rope_theta
    idx = torch.randint(0, shape.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = gpt(idx), llama(idx).logits
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_a_tensor_that_is_not_our_gpts_is_named():
    shape = GPTConfig(n_layers=1, d_model=32, n_heads=2, ffn_hidden=64)
    with pytest.raises(KeyError, match="adapter.weight"):
        gpt_to_llama({"adapter.weight": torch.zeros(2, 2)}, shape)
