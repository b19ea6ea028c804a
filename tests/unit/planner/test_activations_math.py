"""plan.attention=math against the math SDPA kernel's real saved-for-backward bytes (fake tensors, no memory)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_trainopt.models import GPTConfig
from lightning_trainopt.planner import estimate_transformer_activations, measure_activation_bytes
from tests.helpers.gpt import gpt_in_dtype

MHA = GPTConfig(name="mha", vocab_size=256, n_layers=2, d_model=128, n_heads=4, ffn_hidden=256, max_seq_len=1024)
GQA = GPTConfig(
    name="gqa", vocab_size=256, n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=256, max_seq_len=1024
)


def _measure(cfg: GPTConfig, dtype: torch.dtype, autocast: bool, b: int, t: int) -> int:
    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, cfg.vocab_size, (b, t)), torch.randint(0, cfg.vocab_size, (b, t))

    with sdpa_kernel(SDPBackend.MATH):
        return measure_activation_bytes(
            lambda: gpt_in_dtype(cfg, dtype),
            inputs,
            lambda m, x: m.loss(*x),
            autocast_dtype=torch.bfloat16 if autocast else None,
        )


@pytest.mark.parametrize("cfg", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize(
    ("dtype", "autocast", "a"),
    [(torch.float32, False, 4), (torch.float32, True, 2), (torch.bfloat16, False, 2)],
    ids=["fp32", "bf16-mixed", "bf16-true"],
)
@pytest.mark.parametrize("t", [256, 512])
def test_math_attention_within_2_percent_of_the_math_kernel(cfg, dtype, autocast, a, t):
    measured = _measure(cfg, dtype, autocast, 2, t)
    predicted = estimate_transformer_activations(cfg, 2, t, a, autocast, attention="math").bytes("activations")
    assert abs(predicted / measured - 1) <= 0.02, (predicted, measured)


def test_math_keeps_a_quadratic_term_and_sdpa_does_not():
    def acts(attention: str, t: int) -> int:
        return estimate_transformer_activations(MHA, 1, t, 2, True, attention=attention).bytes("activations")

    # SDPA is linear in T (equal steps); math adds fp32 H x T x T probabilities per layer, which linear terms cancel.
    assert acts("sdpa", 1024) - acts("sdpa", 512) == 2 * (acts("sdpa", 512) - acts("sdpa", 256))
    extra = [acts("math", t) - acts("sdpa", t) for t in (512, 1024)]
    assert extra[1] - 2 * extra[0] == MHA.n_layers * 4 * MHA.n_heads * (1024**2 - 2 * 512**2)
