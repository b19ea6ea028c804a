from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter, transform_saved_tensors
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.transforms.compression import (
    Int8Compressor,
    dequantize_blockwise,
    gradient_relative_error,
    quantize_blockwise,
)


def test_quantize_roundtrip_error_is_bounded_per_block() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * torch.logspace(-3, 3, 1000)  # wildly different magnitudes along the row
    q = quantize_blockwise(x, block_size=64)
    assert q.codes.dtype == torch.int8
    assert q.codes.numel() == 3008
    assert q.nbytes == 3008 + 47 * 4
    back = dequantize_blockwise(q)
    assert back.shape == x.shape
    assert back.dtype == x.dtype
    blocks = torch.nn.functional.pad(x.reshape(-1), (0, 8)).view(-1, 64)
    err = torch.nn.functional.pad((back - x).reshape(-1), (0, 8)).view(-1, 64).abs().amax(1)
    assert torch.all(err <= blocks.abs().amax(1) / 127 / 2 + 1e-12)
    zeros = dequantize_blockwise(quantize_blockwise(torch.zeros(100)))
    assert torch.equal(zeros, torch.zeros(100))


def test_bf16_roundtrip_keeps_dtype() -> None:
    x = torch.randn(256, dtype=torch.bfloat16)
    back = dequantize_blockwise(quantize_blockwise(x))
    assert back.dtype == torch.bfloat16
    assert (back.float() - x.float()).abs().max() <= x.float().abs().max() / 127


def test_arguments_validated() -> None:
    with pytest.raises(ConfigError, match="bits"):
        Int8Compressor(bits=4)
    with pytest.raises(ConfigError, match="block_size"):
        Int8Compressor(block_size=0)


def test_views_of_one_storage_share_one_copy_and_params_pass() -> None:
    comp = Int8Compressor(min_numel=16)
    lin = nn.Linear(64, 64, bias=False)
    a = torch.randn(32, 64, requires_grad=True)
    with SavedTensorsCounter() as counter, transform_saved_tensors(comp):
        h = a * 3
        y = lin(h) + lin(h.t().t()) + torch.sin(h)
    report = counter.report()
    assert comp.n_compressed >= 1
    assert comp.n_shared >= 1
    # One int8 copy of h plus its fp32 scales (a * 3 saves nothing) -- no fp32 activation is kept.
    assert report.by_dtype == {"int8": 32 * 64, "float32": 32 * 64 // 64 * 4}
    assert report.parameter_bytes == 64 * 64 * 4  # the weight is passed through, counted as a parameter
    y.sum().backward()
    assert a.grad is not None
    assert lin.weight.grad is not None


def test_freed_storage_is_not_reused_from_cache() -> None:
    """An address freed and reallocated inside one forward must not return the old tensor's codes."""
    comp = Int8Compressor(min_numel=16)
    x = torch.randn(64, 64, requires_grad=True)
    with transform_saved_tensors(comp):
        outs = []
        for i in range(20):
            h = x * float(i + 1)  # new storage each time, often at a reused address
            outs.append(torch.sin(h))
            del h
    sum(o.sum() for o in outs).backward()
    # Each backward must see exactly its own h, quantised: a stale cache hit would give another h's codes.
    expected = sum(
        torch.cos(dequantize_blockwise(quantize_blockwise(x.detach() * float(i + 1)))) * (i + 1) for i in range(20)
    )
    torch.testing.assert_close(x.grad, expected)
    assert comp.n_compressed == 20


def test_model_bytes_cut_and_gradient_error() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, max_seq_len=64)
    model = GPT(cfg)
    x = torch.randint(0, 64, (4, 65))
    with SavedTensorsCounter() as c0:
        loss = model.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SavedTensorsCounter() as c1, transform_saved_tensors(Int8Compressor()):
        loss = model.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    cut = 1 - c1.report().activation_bytes / c0.report().activation_bytes
    err = gradient_relative_error(ref, [p.grad for p in model.parameters()])
    assert cut > 0.45
    assert 0 < err < 0.03


def test_gradient_relative_error() -> None:
    a = [torch.ones(3), None]
    assert gradient_relative_error(a, [torch.ones(3), None]) == 0.0
    assert gradient_relative_error([torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 4.5])]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="gradient"):
        gradient_relative_error([torch.ones(1)], [None])


@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), float("nan")])
def test_non_finite_storages_are_kept_exactly(bad: float) -> None:
    # An inf made its block's scale inf and all 64 values NaN after the round trip.
    x = torch.randn(4096)
    x[5] = bad
    comp = Int8Compressor()
    back = comp.unpack(comp.pack(x))
    assert torch.equal(back.isnan(), x.isnan())
    assert torch.equal(back[~x.isnan()], x[~x.isnan()])
    assert (comp.n_out_of_range, comp.n_compressed) == (1, 0)


def test_mask_values_do_not_zero_their_block() -> None:
    # A finfo.min mask value set the block's scale so high that the other 63 values rounded to zero.
    x = torch.randn(4096)
    x[:32] = torch.finfo(torch.float32).min
    comp = Int8Compressor()
    back = comp.unpack(comp.pack(x))
    assert torch.equal(back, x)
    assert comp.n_out_of_range == 1
    plain = torch.randn(4096)
    close = comp.unpack(comp.pack(plain))
    assert comp.n_compressed == 1
    assert (close - plain).abs().max() < 0.05


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_masked_log_softmax_gradients_stay_finite_and_close(fill: float) -> None:
    torch.manual_seed(0)
    scores = torch.randn(8, 512, requires_grad=True)
    mask = torch.zeros(8, 512, dtype=torch.bool)
    mask[:, 256:] = True

    def loss() -> torch.Tensor:
        return torch.log_softmax(scores.masked_fill(mask, fill), -1)[:, :256].sum()

    loss().backward()
    ref = scores.grad.clone()
    scores.grad = None
    with transform_saved_tensors(Int8Compressor()):
        out = loss()
    out.backward()
    assert torch.isfinite(scores.grad).all()
    assert gradient_relative_error([ref], [scores.grad]) < 1e-6


def test_max_abs_validated() -> None:
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ConfigError, match="max_abs"):
            Int8Compressor(max_abs=bad)
