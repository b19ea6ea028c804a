from __future__ import annotations

import pytest
import torch

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT, GPTConfig

SMALL = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=32)


def test_forward_shape_and_param_count():
    model = GPT(SMALL)
    logits = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    assert sum(p.numel() for p in model.parameters()) == SMALL.n_params()


def test_grouped_query_attention_and_untied_head_count():
    cfg = GPTConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, tie_embeddings=False)
    model = GPT(cfg)
    assert model.blocks[0].attn.k_proj.weight.shape == (2 * 16, 64)
    assert model.lm_head.weight is not model.embed.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params()
    model(torch.randint(0, 256, (2, 8))).sum().backward()


def test_tied_embeddings_share_storage():
    model = GPT(SMALL)
    assert model.lm_head.weight is model.embed.weight


def test_llama_7b_builds_on_meta_device_without_memory():
    cfg = GPTConfig(
        vocab_size=32000,
        n_layers=32,
        d_model=4096,
        n_heads=32,
        ffn_hidden=11008,
        max_seq_len=4096,
        tie_embeddings=False,
    )
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == cfg.n_params() == 6_738_415_616
    assert all(p.is_meta for p in model.parameters())


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    assert torch.allclose(model(x)[0, :8], model(y)[0, :8], atol=1e-5)


def test_sequence_longer_than_rope_tables_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        GPT(SMALL)(torch.randint(0, 256, (1, 33)))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"n_heads": 3}, "model.n_heads"), ({"n_kv_heads": 3}, "model.n_kv_heads"), ({"n_layers": 0}, "model.n_layers")],
)
def test_bad_shapes_are_refused(kwargs, key):
    base = {"n_layers": 2, "d_model": 64, "n_heads": 4, "ffn_hidden": 128}
    with pytest.raises(ConfigError) as err:
        GPTConfig(**{**base, **kwargs})
    assert err.value.key == key


def test_param_groups_decay_matrices_also_when_zero3_partitioned():
    from lightning_trainopt.models.lit_gpt import LitGPT

    module = LitGPT(GPTConfig(name="t", vocab_size=64, n_layers=1, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=8))
    module.configure_model()
    expected = {id(p) for p in module.parameters() if p.dim() >= 2}
    assert expected
    # What ZeRO-3 leaves on every rank: an empty 1-D placeholder, the true shape in ds_shape.
    for p in module.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0, dtype=p.dtype)
    decay, no_decay = module.param_groups()
    assert {id(p) for p in decay["params"]} == expected
    assert no_decay["weight_decay"] == 0.0
    assert len(no_decay["params"]) == sum(1 for _ in module.parameters()) - len(expected)
