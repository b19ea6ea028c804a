"""LLaMA-style decoder-only transformer: RMSNorm, rotary embeddings, SwiGLU, SDPA attention, optional GQA."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.transforms.attention import attention

__all__ = ["GPT", "Block"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Ones, as built (FSDP2's meta-device build materialises the weight empty and calls this)."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16/fp16 autocast, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin tables of shape ``(seq_len, head_dim // 2, 2)`` in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.stack((freqs.cos(), freqs.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)`` by the tables ``rope`` of shape ``(T, D/2, 2)``."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[..., 0], rope[..., 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.kernel = cfg.attention
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        # The configured kernel (SDPA by default, with grouped K/V never repeated); inside documents with doc_ids.
        y = attention(q, k, v, self.kernel, doc_ids)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block; the unit that activation checkpointing and FSDP wrap."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, doc_ids)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """LLaMA-style decoder-only language model.

    Build it under ``torch.device("meta")`` to inspect a 7B model without allocating memory.

    Args:
        cfg: the model's shape.

    Example::

        model = GPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=172))
        logits = model(torch.randint(0, 256, (2, 16)))
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers).

        Module by module through :meth:`_init_weights`, each shared parameter once, in ``named_parameters`` order.
        """
        seen: set[int] = set()
        for module in self.modules():
            if any(id(p) not in seen for p in module.parameters(recurse=False)):
                self._init_weights(module)
            seen.update(id(p) for p in module.parameters(recurse=False))

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise the matrices ``module`` holds itself (not its children's); 1-D parameters keep their values.

        The per-module form of :meth:`reset_parameters` (Hugging Face's ``PreTrainedModel._init_weights`` protocol):
        under ZeRO-3 the strategy gathers one module's parameters at a time and calls this, so re-initialising the
        partitioned model never gathers all of it.
        """
        residual = any(m is module and name.endswith(("o_proj", "down_proj")) for name, m in self.named_modules())
        scale = 1 / math.sqrt(2 * self.config.n_layers) if residual else 1
        for p in module.parameters(recurse=False):
            if len(getattr(p, "ds_shape", p.shape)) >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02 * scale)

    def rope(self, seq_len: int, device: torch.device) -> torch.Tensor:
        # Built per call (cheap) rather than a buffer, so meta-device and sharded copies need no buffer handling.
        return rotary_tables(seq_len, self.config.head_dim, self.config.rope_theta, device=device)

    def forward(
        self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None, return_hidden: bool = False
    ) -> torch.Tensor:
        """Logits of ``(batch, seq)`` token ids, or the normed hidden states before ``lm_head``.

        Args:
            idx: token ids.
            doc_ids: ``(batch, seq)`` document index per position (``transforms.attention.document_ids``): attention
                stays inside each packed document. ``None``: each row is one causal sequence.
            return_hidden: return the hidden states that ``lm_head`` would take (for a loss that applies the head
                itself, e.g. ``transforms.chunked_loss``), not the logits.
        """
        t = idx.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's max_seq_len={self.config.max_seq_len}")
        x = self.embed(idx)
        rope = self.rope(t, idx.device)
        for block in self.blocks:
            x = block(x, rope) if doc_ids is None else block(x, rope, doc_ids)
        hidden = self.norm(x)
        return hidden if return_hidden else self.lm_head(hidden)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in fp32."""
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
