"""The chunked head + cross-entropy equals the plain one and keeps a fraction of its activation bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter
from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss, chunked_cross_entropy
from tests.helpers.runif import RunIf


def _inputs(n=37, d=16, v=50, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = torch.randn(v, d, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100  # padding
    return hidden, weight, b, targets


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_cross_entropy_in_fp32(chunk, bias):
    hidden, weight, b, targets = _inputs(bias=bias)
    expected = F.cross_entropy(F.linear(hidden, weight, b), targets, ignore_index=-100)
    got = chunked_cross_entropy(hidden, weight, targets, b, chunk_tokens=chunk)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    for g, e in zip(_grads(got, hidden, weight, b), _grads(expected, hidden, weight, b)):
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-4)


def test_under_bf16_autocast_it_matches_the_autocast_head():
    hidden, weight, _, targets = _inputs(n=64, d=32, v=128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        got = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=16)
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=2e-3)
    for g, e in zip(_grads(got, hidden, weight), _grads(expected, hidden, weight)):
        assert g.dtype == e.dtype
        assert torch.allclose(g, e, atol=2e-3, rtol=2e-2)


def test_a_batch_of_only_padding_has_zero_loss_and_zero_gradients():
    hidden, weight, _, targets = _inputs()
    loss = chunked_cross_entropy(hidden, weight, torch.full_like(targets, -100), chunk_tokens=8)
    assert loss.item() == 0.0
    assert all(not g.any() for g in _grads(loss, hidden, weight))


def test_the_logits_are_not_kept_for_backward_at_vocabulary_32000():
    n, d, v = 256, 64, 32000
    hidden, weight, _, targets = _inputs(n=n, d=d, v=v)

    def saved(fn):
        with SavedTensorsCounter(params=[weight]) as counter:
            loss = fn()
        del loss
        return counter.report().activation_bytes

    plain = saved(lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets))
    chunked = saved(lambda: chunked_cross_entropy(hidden, weight, targets, chunk_tokens=64))
    assert plain >= 4 * n * v  # the fp32 logits at least
    assert chunked <= 0.2 * plain  # the target: at least 80% less
    assert chunked <= n * d * 4 + n * 4 + n * 8 + 64  # the hidden states, one fp32 lse and one target per token


def test_the_head_runs_through_its_own_call_so_strategy_hooks_fire():
    head = nn.Linear(16, 50, bias=False)
    calls = []
    head.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    head.register_forward_hook(lambda module, args, out: calls.append("post"))
    hidden, _, _, targets = _inputs()
    loss = ChunkedLMHeadLoss(chunk_tokens=8)(head, hidden, targets)
    assert calls == ["pre", "post"]
    expected = F.cross_entropy(head(hidden), targets, ignore_index=-100)
    assert torch.allclose(loss, expected, atol=1e-5)
    assert "forward" not in head.__dict__  # the model is unchanged afterwards
    loss.backward()
    assert head.weight.grad is not None


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_a_bad_chunk_size_names_the_key(bad):
    with pytest.raises(ConfigError, match="loss.chunk_tokens"):
        ChunkedLMHeadLoss(chunk_tokens=bad)


def test_liger_is_refused_without_cuda_naming_the_alternative(monkeypatch):
    from lightning_trainopt.transforms.liger_loss import LigerLMHeadLoss

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="use loss=chunked_ce"):
        LigerLMHeadLoss()


def test_a_head_without_a_weight_is_refused_naming_the_loss():
    with pytest.raises(ConfigError, match="use loss=standard"):
        ChunkedLMHeadLoss()(nn.Identity(), torch.randn(2, 4), torch.zeros(2, dtype=torch.long))


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("kind", ["chunked", "liger"])
def test_on_cuda_both_heads_equal_cross_entropy_in_bf16(kind):
    if kind == "liger":
        pytest.importorskip("liger_kernel")
        from lightning_trainopt.transforms.liger_loss import LigerLMHeadLoss

        loss_fn = LigerLMHeadLoss()
    else:
        loss_fn = ChunkedLMHeadLoss(chunk_tokens=256)
    head = nn.Linear(256, 32000, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 32000, (1024,), device="cuda")
    expected = F.cross_entropy(head(hidden).float(), targets)
    (e_hidden,) = torch.autograd.grad(expected, [hidden])
    got = loss_fn(head, hidden, targets)
    (g_hidden,) = torch.autograd.grad(got, [hidden])
    assert torch.allclose(got.float(), expected, atol=1e-2)
    assert torch.allclose(g_hidden.float(), e_hidden.float(), atol=1e-2, rtol=5e-2)
