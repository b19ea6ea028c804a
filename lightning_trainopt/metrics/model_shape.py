"""Shape of a LLaMA-style decoder-only transformer, as plain data (no torch module, no Lightning)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_trainopt.exceptions import ConfigError

__all__ = ["ATTENTION_KERNELS", "GPTConfig"]

#: ``model.attention``: SDPA choosing its backend, one SDPA backend, or the flash-attn package.
ATTENTION_KERNELS = ("sdpa", "flash", "efficient", "cudnn", "math", "flash_attn")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer (RMSNorm, RoPE, SwiGLU, SDPA attention).

    Args:
        name: preset name, for reports.
        vocab_size: number of token ids.
        n_layers: number of transformer blocks.
        d_model: hidden size.
        n_heads: attention heads.
        n_kv_heads: key/value heads (grouped-query attention); ``None`` means ``n_heads``.
        ffn_hidden: inner size of the SwiGLU MLP.
        max_seq_len: longest sequence the rotary tables are built for.
        tie_embeddings: share the input embedding with the output projection.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        attention: the attention kernel, one of :data:`ATTENTION_KERNELS` (``transforms.attention``).

    Example::

        cfg = GPTConfig(name="tiny", vocab_size=256, n_layers=2, d_model=64, n_heads=4, ffn_hidden=172)
        cfg.n_params()
    """

    name: str = "custom"
    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int = 688
    max_seq_len: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        for key in ("vocab_size", "n_layers", "d_model", "n_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key}", value, "use a positive integer.")
        if self.d_model % self.n_heads:
            raise ConfigError("model.n_heads", self.n_heads, f"choose a divisor of model.d_model={self.d_model}.")
        if self.head_dim % 2:
            raise ConfigError(
                "model.n_heads", self.n_heads, "rotary embeddings need an even head dimension (d_model / n_heads)."
            )
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError("model.attention", self.attention, f"use one of {', '.join(ATTENTION_KERNELS)}.")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ConfigError("model.n_kv_heads", self.n_kv_heads, f"choose a divisor of model.n_heads={self.n_heads}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def block_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, two RMSNorm weights)."""
        d, hd = self.d_model, self.head_dim
        attn = d * d + 2 * d * self.kv_heads * hd + d * d
        mlp = 3 * d * self.ffn_hidden
        return attn + mlp + 2 * d

    def n_params(self) -> int:
        """Exact parameter count of :class:`~lightning_trainopt.models.GPT` built from this config."""
        embed = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return embed + self.n_layers * self.block_params() + self.d_model + head
