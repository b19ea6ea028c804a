"""LitGPT.configure_model builds the model in the dtype its strategy will keep, so building adds no fp32 copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_trainopt.models import GPTConfig, LitGPT
from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy, with_spec

CFG = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=172, vocab_size=256, max_seq_len=64)


def _built(strategy, precision: str, answers: bool = True) -> set[torch.dtype]:
    """The dtypes of a LitGPT built under ``strategy``, carrying the answers parallel/ works out for it (or not)."""
    module = LitGPT(CFG)
    module._trainer = SimpleNamespace(strategy=with_spec(strategy) if answers else strategy, precision=precision)
    module.configure_model()
    return {p.dtype for p in module.parameters()}


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_zero2_half_mixed_builds_half_weights(precision, dtype):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    # The engine casts the module to this dtype anyway; an fp32 build would hold 4 B/param on the device.
    assert _built(DeepSpeedStrategy(stage=2), precision) == {dtype}
    assert torch.get_default_dtype() == torch.float32


def test_fp32_zero3_and_other_strategies_build_as_lightning_asks():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    assert _built(DeepSpeedStrategy(stage=2), "32-true") == {torch.float32}
    # ZeRO-3 builds inside deepspeed.zero.Init, which casts and partitions as it goes.
    assert _built(DeepSpeedStrategy(stage=3), "bf16-mixed") == {torch.float32}
    # Lightning AMP keeps fp32 weights.
    assert _built(DDPStrategy(), "bf16-mixed") == {torch.float32}


def test_the_module_reads_the_strategys_answers_not_its_class():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    # Ours carry their spec from __init__.
    assert _built(TrainOptDeepSpeedStrategy(stage=2), "bf16-mixed", answers=False) == {torch.bfloat16}
    # Lightning's own, built by a user without with_spec: the answerer parallel/ registers when the package is
    # imported answers it, so a user's own Trainer builds as before (half weights under ZeRO-2).
    assert _built(DeepSpeedStrategy(stage=2), "bf16-mixed", answers=False) == {torch.bfloat16}


def test_half_build_draws_the_weights_an_fp32_build_rounds_to():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    torch.manual_seed(0)
    module = LitGPT(CFG)
    module._trainer = SimpleNamespace(strategy=with_spec(DeepSpeedStrategy(stage=2)), precision="bf16-mixed")
    module.configure_model()
    torch.manual_seed(0)
    reference = LitGPT(CFG)
    reference.configure_model()
    for half, full in zip(module.parameters(), reference.parameters()):
        assert torch.equal(half, full.to(torch.bfloat16))
