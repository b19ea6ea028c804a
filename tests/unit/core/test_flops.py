import pytest
import torch
from torch import nn

from lightning_trainopt.core.flops import count_flops, meta_copy, transformer_flops
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT


@pytest.mark.parametrize(
    ("cfg", "seq_len"),
    [
        (GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=172, max_seq_len=64), 64),
        (GPTConfig(n_layers=3, d_model=128, n_heads=8, n_kv_heads=2, ffn_hidden=344, tie_embeddings=False), 128),
    ],
)
def test_analytic_agrees_with_flop_counter(cfg, seq_len):
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(2, seq_len, dtype=torch.long)
    counted = count_flops(model, idx)
    analytic = transformer_flops(cfg, seq_len, batch_size=2)
    assert counted == pytest.approx(analytic.train, rel=0.03)
    assert count_flops(model, idx, backward=False) == pytest.approx(analytic.forward, rel=0.03)


def test_formula_by_hand():
    cfg = GPTConfig(vocab_size=100, n_layers=1, d_model=8, n_heads=2, ffn_hidden=16)
    f = transformer_flops(cfg, seq_len=4, batch_size=1)
    matmul_params = 4 * 8 * 8 + 3 * 8 * 16
    attention = 4 * 2 * 4 * 4 * 4  # 4 * heads * T * T * head_dim
    assert f.forward == 2 * matmul_params * 4 + attention + 2 * 8 * 100 * 4
    assert f.attention_forward == attention
    assert f.train == 3 * f.forward
    assert f.hardware_train(1.0) == f.train + f.block_forward
    assert f.hardware_train(0.5) == f.train + round(f.block_forward / 2)


def test_meta_copy_allocates_nothing_and_keeps_the_original():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    copy = meta_copy(model)
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert all(b.device.type == "meta" for b in copy.buffers())
    assert all(p.device.type == "cpu" for p in model.parameters())
    # forward 2*B*in*out; backward only the weight gradient (the input needs no grad)
    assert count_flops(model, torch.randn(3, 4)) == 2 * (2 * 3 * 4 * 4)
