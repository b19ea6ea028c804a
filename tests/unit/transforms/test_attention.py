"""Attention kernels and attention inside packed documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.attention import (
    attention,
    check_attention,
    cu_seqlens,
    document_ids,
    document_mask,
    hf_attn_implementation,
)
from tests.helpers.runif import RunIf

EOS = 0


def _qkv(b=2, h=4, kv=2, t=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, t, d, generator=g) for n in (h, kv, kv))


def test_document_ids_start_a_new_document_after_each_eos():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8], [EOS, 1, 2, 3, 4, 5]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]


def test_the_mask_is_causal_and_block_diagonal():
    mask = document_mask(torch.tensor([[0, 0, 1, 1]]))[0, 0]
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]


def test_cu_seqlens_offsets_every_document_of_every_row():
    offsets, longest = cu_seqlens(torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]))
    assert offsets.tolist() == [0, 3, 5, 6, 7, 12]
    assert offsets.dtype == torch.int32
    assert longest == 5


@pytest.mark.parametrize("kernel", ["sdpa", "flash", "math"])
def test_attention_within_documents_equals_each_document_on_its_own(kernel):
    q, k, v = _qkv()
    tokens = torch.tensor([[3, 4, EOS, 5, 6, 7, EOS, 8, 9, 1, 2, 3], [1, 2, 3, 4, 5, 6, 7, EOS, 1, 2, 3, 4]])
    doc = document_ids(tokens, EOS)
    out = attention(q, k, v, kernel, doc_ids=doc)
    for row in range(2):
        for d in doc[row].unique():
            idx = (doc[row] == d).nonzero().squeeze(1)
            alone = F.scaled_dot_product_attention(
                q[row : row + 1, :, idx], k[row : row + 1, :, idx], v[row : row + 1, :, idx], is_causal=True,
                enable_gqa=True,
            )  # fmt: skip
            assert torch.allclose(out[row : row + 1, :, idx], alone, atol=1e-5)


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_a_chosen_backend_computes_what_sdpa_does(kernel):
    q, k, v = _qkv()
    assert torch.allclose(attention(q, k, v, kernel), attention(q, k, v, "sdpa"), atol=1e-5)


@pytest.mark.parametrize(
    ("name", "on_cuda", "fix"),
    [
        ("efficient", False, "on a CPU use flash, math or sdpa"),
        ("cudnn", False, "on a CPU use flash, math or sdpa"),
        ("flash_attn", False, "CUDA GPUs only"),
        ("flashattn", False, "use one of sdpa, flash, efficient, cudnn, math, flash_attn"),
    ],
)
def test_what_cannot_run_here_is_refused_with_what_can(name, on_cuda, fix):
    with pytest.raises(ConfigError, match=fix):
        check_attention(name, on_cuda)


def test_flash_attn_without_the_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    with pytest.raises(ConfigError, match=r"lightning_trainopt\[gpu\]"):
        check_attention("flash_attn", on_cuda=True)


def test_cpu_kernels_pass_the_check_and_map_to_hugging_face_names():
    for name in ("sdpa", "flash", "math"):
        check_attention(name, on_cuda=False)
    assert hf_attn_implementation("flash_attn") == "flash_attention_2"
    assert hf_attn_implementation("math") == "sdpa"


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn", "flash_attn"])
def test_on_cuda_each_kernel_matches_math_with_and_without_documents(kernel):
    if kernel == "flash_attn":
        pytest.importorskip("flash_attn")
    q, k, v = (x.cuda().bfloat16() for x in _qkv(t=64, d=64))
    tokens = torch.randint(1, 50, (2, 64), device="cuda")
    tokens[:, 20] = EOS
    for doc in (None, document_ids(tokens, EOS)):
        assert torch.allclose(attention(q, k, v, kernel, doc), attention(q, k, v, "math", doc), atol=2e-2)
