"""Analytic activation bytes against the generic measured path (fake tensors, metrics.saved_tensors)."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPTConfig
from lightning_trainopt.planner import (
    ActivationPolicy,
    estimate_transformer_activations,
    measure_activation_bytes,
)
from tests.helpers.gpt import gpt_in_dtype

TINY = GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, ffn_hidden=160, max_seq_len=256)
GQA = GPTConfig(
    vocab_size=512,
    n_layers=3,
    d_model=128,
    n_heads=8,
    n_kv_heads=2,
    ffn_hidden=320,
    max_seq_len=256,
    tie_embeddings=False,
)


def _measured(cfg: GPTConfig, b: int, t: int, dtype: torch.dtype, autocast: bool) -> int:
    def loss(model, inputs):
        x, y = inputs
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    return measure_activation_bytes(
        lambda: gpt_in_dtype(cfg, dtype),
        lambda: (torch.randint(0, cfg.vocab_size, (b, t)), torch.randint(0, cfg.vocab_size, (b, t))),
        loss_fn=loss,
    )


@pytest.mark.parametrize("cfg", [TINY, GQA], ids=["mha", "gqa_untied"])
@pytest.mark.parametrize(
    ("dtype", "autocast", "compute"),
    [(torch.float32, False, 4), (torch.float32, True, 2), (torch.bfloat16, False, 2)],
    ids=["fp32", "bf16-mixed", "bf16-true"],
)
@pytest.mark.parametrize(("b", "t"), [(1, 32), (3, 96)])
def test_analytic_matches_measured_saved_bytes(cfg, dtype, autocast, compute, b, t):
    predicted = estimate_transformer_activations(cfg, b, t, compute, autocast).bytes("activations")
    assert predicted == _measured(cfg, b, t, dtype, autocast)


def test_generic_path_counts_a_foreign_module():
    def build():
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    got = measure_activation_bytes(build, lambda: (torch.randn(10, 32),))
    # Linear saves its input (10x32), ReLU its output (10x64, also the 2nd Linear's input); fp32.
    assert got == 4 * (10 * 32 + 10 * 64)


def test_sdpa_is_linear_in_seq_len_and_math_is_quadratic():
    def blocks(t: int, attention: str) -> int:
        est = estimate_transformer_activations(TINY, 1, t, 2, False, attention=attention)
        return next(x.nbytes for x in est.terms if x.label.endswith("full blocks"))

    assert blocks(128, "sdpa") == 2 * blocks(64, "sdpa")
    assert blocks(128, "math") > 2 * blocks(64, "math")


def test_checkpointing_keeps_block_inputs_and_adds_a_recompute_transient():
    full = estimate_transformer_activations(TINY, 2, 64, 4, False)
    ckpt = estimate_transformer_activations(TINY, 2, 64, 4, False, ActivationPolicy(checkpoint_every=1))
    inputs = next(x for x in ckpt.terms if "checkpointed" in x.label)
    assert inputs.nbytes == TINY.n_layers * 2 * 64 * 4 * TINY.d_model
    assert ckpt.bytes("activations") < full.bytes("activations")
    assert ckpt.bytes("other") > full.bytes("other")  # one block's activations rebuilt during backward


def test_int8_and_offload_change_bytes_and_place():
    base = estimate_transformer_activations(TINY, 4, 128, 4, False).bytes("activations")
    int8 = estimate_transformer_activations(TINY, 4, 128, 4, False, ActivationPolicy(compress_bits=8))
    assert int8.bytes("activations") < base / 3
    off = estimate_transformer_activations(TINY, 4, 128, 4, False, ActivationPolicy(offload=True))
    assert off.bytes("activations") + off.bytes("activations", "cpu") == base
    assert 0 < off.bytes("activations") < base / 50  # storages under min_numel=1024 elements stay on the device


def _saved_storages(b: int, t: int, dtype: torch.dtype, autocast: bool) -> list[tuple[int, int]]:
    """(bytes, elements) of each distinct non-parameter storage a real CPU forward saves for backward."""
    model = gpt_in_dtype(TINY, dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, int]] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = (storage.nbytes(), storage.nbytes() // x.element_size())
        return x

    x, y = torch.randint(0, TINY.vocab_size, (b, t)), torch.randint(0, TINY.vocab_size, (b, t))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
    return list(seen.values())


@pytest.mark.parametrize(
    ("dtype", "autocast", "compute"), [(torch.float32, False, 4), (torch.float32, True, 2)], ids=["fp32", "bf16-mixed"]
)
def test_offload_counts_each_pinned_block_at_its_power_of_two(dtype, autocast, compute):
    # CpuOffloader copies each storage of >= min_numel elements into torch.empty(n, pin_memory=True); torch 2.13's
    # CachingHostAllocator serves PowerOf2Ceil(bytes) (ATen/core/CachingHostAllocator.h, no round threshold by
    # default). No pinned memory without CUDA here: the rule is applied to the storages a real forward saves.
    b, t, min_numel = 3, 96, 1024
    storages = _saved_storages(b, t, dtype, autocast)
    moved = [n for n, k in storages if k >= min_numel]
    est = estimate_transformer_activations(TINY, b, t, compute, autocast, ActivationPolicy(offload=True))
    assert est.bytes("activations") == sum(n for n, k in storages if k < min_numel)
    assert est.bytes("activations", "cpu") == sum(moved)
    pinned = sum(1 << (n - 1).bit_length() for n in moved)
    assert est.bytes(location="cpu") == pinned > sum(moved)
    unpinned = ActivationPolicy(offload=True, offload_pin_memory=False)
    assert estimate_transformer_activations(TINY, b, t, compute, autocast, unpinned).bytes(location="cpu") == sum(moved)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"micro_batch": 0}, "data.batch_size"),
        ({"seq_len": 10_000}, "data.seq_len"),
        ({"attention": "xformers"}, "plan.attention"),
    ],
)
def test_bad_input_raises_with_key(kwargs, key):
    args = {"micro_batch": 1, "seq_len": 16, "attention": "sdpa", **kwargs}
    with pytest.raises(ConfigError, match=key):
        estimate_transformer_activations(
            TINY, args["micro_batch"], args["seq_len"], 4, False, attention=args["attention"]
        )


def test_bad_offload_min_numel_names_the_key():
    with pytest.raises(ConfigError, match=r"activations\.activation_offload\.min_numel"):
        ActivationPolicy(offload=True, offload_min_numel=0)
