"""What a Megatron-style tensor-parallel plan splits of a model, as one plain value, and the one divisibility check.

The app's pre-flight (``config/tp_preflight.py``), the TP rewrite (``parallel/tp.py``) and the planner (its search
over TP sizes, ``plan.py ... strategy.tensor_parallel_size=K``) all ask :func:`tp_divisibility_errors`, so a size the
app refuses is never planned and the other way round. It lives here, the lowest room that needs it (the planner is
pure and sits below ``parallel/``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TP_HF_ARCHITECTURES", "TPShape", "tp_divisibility_errors"]

#: Hugging Face ``model_type``s with a tensor-parallel plan (``parallel.tp.ARCHITECTURES`` adds our ``gpt``).
TP_HF_ARCHITECTURES = ("llama", "mistral", "qwen2")

_NAMES = {"heads": "attention heads", "kv_heads": "key/value heads", "ffn": "FFN width", "vocab": "vocabulary"}


@dataclass(frozen=True)
class TPShape:
    """The sizes of a transformer that tensor parallelism splits or charges for.

    Named as :class:`~lightning_trainopt.metrics.model_shape.GPTConfig` names them, so either serves the planner's
    TP formulas (Korthikanti's activations, the collectives' bytes).

    Args:
        architecture: the plan (``gpt``, ``llama``, ``mistral``, ``qwen2``: ``parallel.tp.ARCHITECTURES``).
        d_model: hidden size (the residual stream every TP collective moves).
        n_heads: query heads.
        kv_heads: key/value heads (grouped-query attention: fewer than ``n_heads``).
        ffn_hidden: the gated FFN's inner width (gate/up columns, down rows).
        vocab_size: rows of the embedding and the head.
        n_layers: transformer blocks.

    Example::

        TPShape("llama", d_model=4096, n_heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=128256, n_layers=32)
    """

    architecture: str
    d_model: int
    n_heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int
    n_layers: int

    def sizes(self) -> dict[str, int]:
        """``heads``, ``kv_heads``, ``ffn``, ``vocab``: what :func:`tp_divisibility_errors` checks."""
        return {"heads": self.n_heads, "kv_heads": self.kv_heads, "ffn": self.ffn_hidden, "vocab": self.vocab_size}


def tp_divisibility_errors(shape: dict[str, int], tp: int, seq_len: int | None = None) -> list[str]:
    """What of a model's shape the tensor-parallel size ``tp`` does not divide (empty: every size divides).

    Args:
        shape: ``heads``, ``kv_heads``, ``ffn``, ``vocab`` (the model's sizes; :meth:`TPShape.sizes`).
        tp: tensor-parallel size.
        seq_len: the training sequence length (sequence parallelism splits it), ``None``: not checked.
    """
    errors = [f"{_NAMES[k]} {shape[k]}" for k in _NAMES if k in shape and shape[k] % tp]
    if seq_len is not None and seq_len % tp:
        errors.append(f"sequence length {seq_len} (sequence parallelism splits it)")
    return errors
