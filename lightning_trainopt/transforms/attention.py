"""Attention kernels: a chosen SDPA backend or the flash-attn package, and attention within packed documents.

``model.attention`` picks the kernel:

- ``sdpa``: torch's ``scaled_dot_product_attention`` choosing its backend (the default);
- ``flash``, ``efficient``, ``cudnn``, ``math``: that SDPA backend only (``torch.nn.attention.sdpa_kernel``). On a
  CPU torch has ``flash`` and ``math``; ``efficient`` and ``cudnn`` are CUDA kernels;
- ``flash_attn``: the flash-attn package (``pip install 'lightning_trainopt[gpu]'``, CUDA only), with
  ``flash_attn_varlen_func`` over packed documents.

Packed training sequences hold several documents separated by EOS. With the documents' boundaries (``doc_ids``:
the document index of each position), attention stays inside each document: flash-attn's variable-length kernel
(``cu_seqlens``), or SDPA with a block-diagonal causal mask.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.model_shape import ATTENTION_KERNELS

__all__ = [
    "ATTENTION_CHOICES",
    "attention",
    "attention_context",
    "check_attention",
    "cu_seqlens",
    "document_ids",
    "document_mask",
    "hf_attn_implementation",
]

ATTENTION_CHOICES = ATTENTION_KERNELS
_CUDA_ONLY = {"efficient": "memory-efficient", "cudnn": "cuDNN"}
_INSTALL = "pip install 'lightning_trainopt[gpu]' (flash-attn builds against CUDA)"


def check_attention(name: str, on_cuda: bool, key: str = "model.attention") -> None:
    """Refuse a kernel that cannot run here, before training.

    Raises:
        ConfigError: an unknown name, a CUDA-only SDPA backend without CUDA, or ``flash_attn`` without CUDA or the
            package; the message says what runs instead.
    """
    if name not in ATTENTION_CHOICES:
        raise ConfigError(key, name, f"use one of {', '.join(ATTENTION_CHOICES)}.")
    if name in _CUDA_ONLY and not on_cuda:
        raise ConfigError(
            key, name, f"SDPA's {_CUDA_ONLY[name]} kernel runs on CUDA only; on a CPU use flash, math or sdpa."
        )
    if name == "flash_attn":
        if not on_cuda:
            raise ConfigError(key, name, "the flash-attn package runs on CUDA GPUs only; on a CPU use sdpa or flash.")
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(key, name, f"flash-attn is not installed: {_INSTALL}; or use sdpa.")


def _backends(name: str) -> list[Any] | None:
    from torch.nn.attention import SDPBackend

    table = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return [table[name]] if name in table else None


def attention_context(name: str) -> Any:
    """A context in which every SDPA call uses the chosen backend (for models that call SDPA themselves)."""
    backends = _backends(name)
    if backends is None:
        return nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def hf_attn_implementation(name: str) -> str:
    """The Hugging Face ``attn_implementation`` for a kernel: ``flash_attention_2`` for flash-attn, else ``sdpa``."""
    return "flash_attention_2" if name == "flash_attn" else "sdpa"


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document index of each position of packed ``(batch, seq)`` tokens; a new document starts after an EOS."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=-1) - ends  # an EOS belongs to the document it ends


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, seq, seq)`` boolean mask: position ``i`` attends to ``j <= i`` of the same document."""
    t = doc_ids.shape[-1]
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal).unsqueeze(1)


def cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """flash-attn's ``cu_seqlens`` (int32 offsets of each document in the flattened batch) and the longest length.

    Each row's documents are separate sequences; a document never spans two rows.
    """
    b, t = doc_ids.shape
    lengths: list[int] = []
    for row in doc_ids:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        lengths.extend(int(c) for c in counts)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=doc_ids.device)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=doc_ids.device), 0)
    assert int(offsets[-1]) == b * t
    return offsets, max(lengths)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: str = "sdpa",
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``(batch, heads, seq, head_dim)`` tensors with the chosen kernel; grouped K/V allowed.

    Args:
        q: queries; ``k``, ``v`` may have fewer heads (GQA) that divide ``q``'s.
        kernel: one of :data:`ATTENTION_CHOICES`.
        doc_ids: ``(batch, seq)`` document index per position (:func:`document_ids`): attention stays within each
            document. ``None``: one causal sequence per row.

    Returns:
        ``(batch, heads, seq, head_dim)``.
    """
    gqa = k.shape[1] != q.shape[1]
    if kernel == "flash_attn":
        return _flash_attn(q, k, v, doc_ids)
    with attention_context(kernel) if kernel != "sdpa" else nullcontext():
        if doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids), enable_gqa=gqa)


def _flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    b, h, t, d = q.shape
    # flash-attn takes (batch, seq, heads, head_dim) and handles grouped K/V heads itself.
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if doc_ids is None:
        out = flash_attn_func(qt, kt, vt, causal=True)
    else:
        offsets, longest = cu_seqlens(doc_ids)
        flat = [x.reshape(b * t, x.shape[2], d) for x in (qt, kt, vt)]
        out = flash_attn_varlen_func(*flat, offsets, offsets, longest, longest, causal=True).view(b, t, h, d)
    return out.transpose(1, 2)
