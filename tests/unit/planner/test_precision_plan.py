"""The planner's FP8 layers, fp32-kept modules and chunked loss: saved bytes, FLOPs at the FP8 peak, the search."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPTConfig
from lightning_trainopt.planner import (
    ActivationPolicy,
    LossPlan,
    PlanInputs,
    PrecisionPlan,
    SearchSpace,
    StrategyLayout,
    estimate_plan,
    estimate_speed,
    estimate_transformer_activations,
    measure_activation_bytes,
    search_plans,
)
from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss
from tests.helpers.gpt import gpt_in_dtype

CFG = GPTConfig(name="c", vocab_size=1024, n_layers=2, d_model=128, n_heads=4, ffn_hidden=256, max_seq_len=512)
CHUNKED = LossPlan("chunked_ce", "chunked", 64)


def _chunked_measured(dtype: torch.dtype, autocast: bool, b: int, t: int) -> int:
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        head = model.lm_head
        model.lm_head = nn.Identity()
        hidden = model(x)
        model.lm_head = head
        return ChunkedLMHeadLoss(64)(head, hidden, y)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)

    return measure_activation_bytes(
        lambda: gpt_in_dtype(CFG, dtype),
        inputs,
        lambda m, x: loss(m, x),
        autocast_dtype=torch.bfloat16 if autocast else None,
    )


@pytest.mark.parametrize(
    ("dtype", "autocast", "a"),
    [(torch.float32, False, 4), (torch.float32, True, 2), (torch.bfloat16, False, 2)],
    ids=["fp32", "bf16-mixed", "bf16-true"],
)
def test_chunked_loss_equals_its_saved_bytes_on_fake_tensors(dtype, autocast, a):
    measured = _chunked_measured(dtype, autocast, 2, 128)
    predicted = estimate_transformer_activations(CFG, 2, 128, a, autocast, loss=CHUNKED).bytes("activations")
    assert predicted == measured


def test_chunked_loss_drops_the_log_softmax_and_the_head_copy():
    bt, d, v = 2 * 128, CFG.d_model, CFG.vocab_size
    standard = estimate_transformer_activations(CFG, 2, 128, 2, True).bytes("activations")
    chunked = estimate_transformer_activations(CFG, 2, 128, 2, True, loss=CHUNKED).bytes("activations")
    # bf16 head input (2d) + fp32 log-softmax (4V) + loss weight (4 B) + bf16 head weight copy (2 V d) out; the fp32
    # hidden states (4d), the log-sum-exp (4) and the int64 token count (8 B) in.
    assert standard - chunked == bt * (2 * d + 4 * v) + 4 + 2 * v * d - bt * (4 * d + 4) - 8


def test_chunked_loss_holds_one_chunk_of_logits_in_backward():
    def transient(loss: LossPlan | None) -> int:
        est = estimate_transformer_activations(CFG, 4, 512, 2, True, loss=loss)
        return next(t.nbytes for t in est.terms if "logits" in t.label)

    assert transient(None) == (2 + 4) * 4 * 512 * CFG.vocab_size
    assert transient(CHUNKED) == (2 + 12) * 64 * CFG.vocab_size + 4 * CFG.vocab_size * CFG.d_model


def test_loss_plan_is_checked():
    with pytest.raises(ConfigError, match="loss.chunk_tokens"):
        LossPlan("chunked_ce", "chunked", 0)
    with pytest.raises(ConfigError, match="loss"):
        LossPlan("mine", "focal")


def test_fp8_flops_run_at_the_fp8_peak_and_the_rest_at_bf16():
    # 1e9 FLOP/token, 60% in FP8 layers: 0.4e9 at 100 TFLOP/s and 0.6e9 at 200, both at 50%.
    s = estimate_speed(1e9, 1000, 1, 100e12, 0.5, None, 1e9, fp8_flops_share=0.6, fp8_peak_flops=200e12)
    assert s.compute_s == pytest.approx(1000 * (0.4e9 / 100e12 + 0.6e9 / 200e12) / 0.5)
    assert s.peak_flops == 100e12  # the implied MFU is against the bf16 peak
    assert "FP8 peak" in s.source


def test_no_fp8_peak_invents_no_speed_up():
    plain = estimate_speed(1e9, 1000, 1, 100e12, 0.5, None, 1e9)
    emulated = estimate_speed(1e9, 1000, 1, 100e12, 0.5, None, 1e9, fp8_flops_share=0.6, emulated=True)
    assert emulated.compute_s == plain.compute_s
    assert "emulated" in emulated.source
    assert "no FP8 speed-up" in emulated.source


def _inputs(**kw: object) -> PlanInputs:
    base = PlanInputs(model=CFG, trainer_precision="bf16-mixed", micro_batch=2, seq_len=128)
    return replace(base, **kw)


def _linears(cfg: GPTConfig) -> tuple[tuple[int, int], ...]:
    d, f = cfg.d_model, cfg.ffn_hidden
    block = ((d, d), (d, d), (d, d), (d, d), (f, d), (f, d), (d, f))
    return block * cfg.n_layers


def test_fp8_share_of_the_flops_uses_the_fp8_peak():
    shapes = _linears(CFG)
    plan = PrecisionPlan("fp8", "torchao", "tensorwise", fp8_shapes=shapes, linear_shapes=shapes)
    e = estimate_plan(_inputs(precision=plan), None, 100e12, None, 0.5, fp8_peak_flops=200e12)
    tokens = 2 * 128
    model = estimate_plan(_inputs(), None, 100e12, None, 0.5)
    share = 6 * sum(n * k for n, k in shapes) * tokens / (model.train_flops_per_token * tokens)
    assert e.speed.fp8_flops_share == pytest.approx(share)
    assert e.speed.tokens_per_sec_per_device > model.speed.tokens_per_sec_per_device


def test_transformer_engine_is_derived_per_converted_layer():
    shapes = _linears(CFG)
    te = PrecisionPlan("fp8_te", "transformer_engine", "delayed", fp8_shapes=shapes, linear_shapes=shapes)
    bf16 = estimate_plan(_inputs(), None, None, None)
    e = estimate_plan(_inputs(precision=te), None, None, None)
    tokens = 2 * 128
    inputs = sum(k for _, k in shapes)
    weights = sum(n * k for n, k in shapes)
    delta = -tokens * inputs - weights + 8 * len(shapes)
    assert e.memory.bytes("activations") - bf16.memory.bytes("activations") == delta
    casts = next(t for t in e.memory.terms if t.label.startswith("FP8 casts"))
    assert casts.phase == "backward"
    # Checkpointing every block: the blocks keep only their inputs, so the per-layer change is gone.
    ckpt = ActivationPolicy(checkpoint_every=1)
    assert estimate_plan(_inputs(precision=te, activations=ckpt), None, None, None).memory.bytes(
        "activations"
    ) == estimate_plan(_inputs(activations=ckpt), None, None, None).memory.bytes("activations")


def test_a_measured_precision_replaces_the_profile_activations():
    from lightning_trainopt.planner.terms import MemoryEstimate, Term

    seen: list[str] = []

    def measure(kind: str):
        seen.append(kind)
        return lambda *args: MemoryEstimate.of([Term("activations", "device", "measured", 123, phase="backward")])

    plan = PrecisionPlan("bf16", None, None, fp32_modules=("model.norm",), measure=measure)
    e = estimate_plan(_inputs(precision=plan, loss=CHUNKED), None, None, None)
    assert e.memory.bytes("activations") == 123
    assert seen == ["chunked"]


def test_search_chooses_precision_and_loss():
    shapes = _linears(CFG)
    fp8 = PrecisionPlan("fp8", "torchao", "tensorwise", fp8_shapes=shapes, linear_shapes=shapes)
    space = SearchSpace(
        {"bf16": "bf16-mixed", "fp8": "bf16-mixed"},
        {"none": StrategyLayout(name="none", kind="single")},
        {"none": ActivationPolicy()},
        {"adamw": _inputs().optimizer},
        (2,),
        precision_plans={"fp8": fp8},
        losses={"standard": LossPlan(), "chunked_ce": CHUNKED},
    )

    def run(i: PlanInputs):
        return estimate_plan(i, 2**40, 100e12, 1.0, 0.4, fp8_peak_flops=200e12)

    ranked, n = search_plans(_inputs(), space, run)
    assert n == 4
    assert {tuple(sorted(c.choices.items())) for c in ranked} == {
        (("activations", "none"), ("loss", loss), ("optimizer", "adamw"), ("precision", p), ("strategy", "none"))
        for p in ("bf16", "fp8")
        for loss in ("standard", "chunked_ce")
    }
    # FP8 is cheaper per token; at the same price the chunked loss leaves more memory.
    assert ranked[0].choices["precision"] == "fp8"
    assert ranked[0].choices["loss"] == "chunked_ce"
    assert ranked[0].estimate.inputs.precision is fp8
