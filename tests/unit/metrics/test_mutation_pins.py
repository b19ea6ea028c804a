"""Pins for core arithmetic at factors the other tests only ever set to 1 or 0.

Batch size, grouped-query heads and recompute fractions other than 0 and 1 in the FLOPs formula; world size and the
hardware-FLOPs fallback in throughput; several devices with a token target in the cost projection; accumulation and
merged windows in the step split; the verdict's thresholds at their boundaries. Expected values are worked out by
hand in the comments.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import torch

from lightning_trainopt.metrics.cost import cost_report
from lightning_trainopt.metrics.flops import SeqFlops, transformer_flops
from lightning_trainopt.metrics.memory_accounting import memory_breakdown
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.metrics.step_time import StepSplit, split_marks, step_verdict
from lightning_trainopt.metrics.throughput import throughput

# ---------------------------------------------------------------- FLOPs: batch size, GQA, partial recompute


def test_transformer_flops_with_grouped_query_heads_a_batch_of_3_and_partial_recompute():
    # d=8, 2 heads of 4, one key/value head, FFN 16, two blocks, vocabulary 100; 3 sequences of 4 tokens (12 tokens).
    cfg = GPTConfig(vocab_size=100, n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=4)
    f = transformer_flops(cfg, seq_len=4, batch_size=3)
    # Matmul weights per block: q 8x8 = 64, k and v 2 x 8x4 = 64, o 64, SwiGLU 3 x 8x16 = 384: 576.
    # Attention per block: 4 x B 3 x H 2 x T 4 x T 4 x hd 4 = 1,536. Blocks: 2 x (2 x 576 x 12 + 1,536) = 30,720.
    assert f.attention_forward == 2 * 1536
    assert f.block_forward == 30_720
    # lm_head: 2 x 8 x 100 x 12 = 19,200.
    assert f.forward == 30_720 + 19_200
    assert f.train == 3 * 49_920
    # Recompute skips each block's down-projection: 2 blocks x 2 x 16 x 8 x 12 tokens = 6,144.
    assert f.block_recompute == 30_720 - 6144
    assert f.hardware_train(0.5) == 149_760 + 12_288
    assert f.hardware_train(0.25) == 149_760 + 6144
    assert f.hardware_train(0.1) == 149_760 + 2458  # 2,457.6 FLOPs, to the nearest whole one
    assert f.hardware_train() == f.train
    # Linear in the batch: one sequence costs a third.
    one = transformer_flops(cfg, seq_len=4, batch_size=1)
    assert (3 * one.forward, 3 * one.block_recompute) == (f.forward, f.block_recompute)


def test_seq_flops_polynomial_and_its_recomputed_part():
    # B x (c + a T + b T^2) with c=10, a=3, b=1; recomputed 2 T per sequence.
    fit = SeqFlops(
        Fraction(10), Fraction(3), Fraction(1), (4, 2, 1, 3), "forward(x)", (Fraction(0), Fraction(2), Fraction(0))
    )
    assert fit(2, 4) == 2 * (10 + 3 * 4 + 16)
    assert fit.hardware(2, 4) == 76 + 2 * 8
    assert fit(3, None) == 30  # no sequence dimension: B x c
    assert fit.applies_to(4)
    assert not fit.applies_to(None)
    assert SeqFlops(Fraction(5), Fraction(0), Fraction(0), (), "forward(x)").applies_to(None)


# ---------------------------------------------------------------- throughput: world size 8, no hardware count


def test_throughput_totals_at_world_size_8_and_hfu_from_model_flops_without_a_hardware_count():
    w = throughput(seconds=4.0, samples=6, tokens=600, world_size=8, model_flops=2e12, peak_flops=1e12)
    assert (w.samples_per_s, w.tokens_per_s) == (1.5, 150.0)
    assert (w.samples_per_s_total, w.tokens_per_s_total) == (12.0, 1200.0)
    # 2e12 FLOPs in 4 s on a 1e12 FLOP/s peak: 0.5 TFLOP/s, MFU 0.5; no recomputation counted: HFU = MFU.
    assert (w.tflops_per_s, w.mfu, w.hfu) == (0.5, 0.5, 0.5)
    assert w.to_dict()["seconds"] == 4.0


# ---------------------------------------------------------------- cost: several devices with a token target


def test_token_target_projection_bills_every_device():
    # 1,000 tokens in 600 s; 3,000 more take 1,800 s. Spent: 600 s x 4 devices = 2/3 device-hour x $3 = $2;
    # the rest 1,800 s x 4 = 2 device-hours = $6. Lost idle: 25% of $2.
    r = cost_report(600, 4, 3.0, tokens=1000, tokens_target=4000, idle_fraction=0.25, samples=50)
    assert r.device_hours == pytest.approx(4 * 600 / 3600)
    assert r.dollars == pytest.approx(2.0)
    assert r.projected_seconds_left == pytest.approx(1800.0)
    assert r.projected_total_dollars == pytest.approx(8.0)
    assert r.dollars_lost_idle == pytest.approx(0.5)
    assert r.dollars_per_1b_tokens == pytest.approx(2.0 / 1000 * 1e9)
    assert r.dollars_per_1m_samples == pytest.approx(2.0 / 50 * 1e6)
    # Past the target: nothing left, not a negative time.
    assert cost_report(600, 4, 3.0, tokens=5000, tokens_target=4000).projected_seconds_left == 0.0


def test_step_projection_counts_only_the_current_runs_steps():
    # 20 steps done, 5 of them before the resume: 15 in 300 s, 80 left take 1,600 s.
    r = cost_report(300, 2, 1.0, tokens=None, steps_done=20, steps_total=100, prior_steps=5)
    assert r.projected_seconds_left == pytest.approx(1600.0)
    assert r.projected_total_dollars == pytest.approx(2 * 300 / 3600 + 2 * 1600 / 3600)
    # Nothing done in the current run yet: no rate, no projection.
    fresh = cost_report(300, 2, 1.0, tokens=None, steps_done=5, steps_total=100, prior_steps=5)
    assert fresh.projected_seconds_left is None


# ---------------------------------------------------------------- step split: accumulation 4, merged windows


def _micro_batch(t: float, steps: bool) -> list[tuple[str, float]]:
    """One micro-batch from ``t``: 1 s forward, 2 s backward, then (if it steps) 1 s in the optimizer; 4 s long."""
    marks = [("batch_start", t), ("before_backward", t + 1), ("after_backward", t + 3)]
    if steps:
        marks.append(("before_optimizer_step", t + 3))
    return [*marks, ("batch_end", t + 4 if steps else t + 3)]


def test_accumulation_4_counts_one_step_per_4_micro_batches():
    # Two optimizer steps of 4 micro-batches each; micro-batches start every 4 s (the non-stepping ones leave a 1 s
    # gap in no phase).
    marks = [m for k in range(8) for m in _micro_batch(4.0 * k, steps=k % 4 == 3)]
    s = split_marks(marks)
    assert s.steps == 2
    assert s.seconds["forward"] == 8.0
    assert s.seconds["backward"] == 16.0
    assert s.seconds["optimizer"] == 2.0
    assert s.wall == 32.0
    assert s.fractions()["other"] == pytest.approx(6.0 / 32.0)


def test_merged_windows_add_seconds_wall_and_steps():
    a = split_marks(_micro_batch(0.0, steps=True))
    b = split_marks(_micro_batch(10.0, steps=True), comm_measured=True)
    a.merge(b)
    assert (a.seconds["forward"], a.seconds["backward"], a.seconds["optimizer"]) == (2.0, 4.0, 2.0)
    assert (a.wall, a.steps, a.comm_measured) == (8.0, 2, True)
    assert a.to_dict() == {"seconds": a.seconds, "wall": 8.0, "steps": 2, "comm_measured": True}
    with pytest.raises(KeyError, match="unknown phase"):
        a.add("compile", 1.0)


# ---------------------------------------------------------------- verdict thresholds at their boundaries


def _split(**seconds: float) -> StepSplit:
    s = StepSplit(wall=10.0, steps=5)
    for k, v in seconds.items():
        s.add(k, v)
    return s


def test_a_share_equal_to_a_threshold_does_not_cross_it():
    # 15% waiting for data is not yet input-bound (above 15% is); 30% in the optimizer not yet optimizer-bound.
    assert step_verdict(_split(data_wait=1.5, forward=4.0, backward=4.5)).kind == "compute-bound"
    assert step_verdict(_split(data_wait=1.6, forward=4.0, backward=4.4)).kind == "input-bound"
    assert step_verdict(_split(optimizer=3.0, forward=3.0, backward=4.0)).kind == "compute-bound"
    assert step_verdict(_split(optimizer=3.1, forward=3.0, backward=3.9)).kind == "optimizer/offload-bound"


@pytest.mark.parametrize(("cpu_count", "target"), [(1, 2), (4, 4), (16, 8), (None, 8)])
def test_worker_advice_is_the_cpu_count_between_2_and_8(cpu_count, target):
    v = step_verdict(_split(data_wait=5.0, forward=5.0), num_workers=0, cpu_count=cpu_count)
    assert f"raise data.num_workers from 0 to {target}" in v.remedies


# ---------------------------------------------------------------- memory accounting of ZeRO partitions (world > 1)


class _ZeroOptimizer:
    """The attributes ``memory_breakdown`` reads from a DeepSpeed ZeRO optimizer, without DeepSpeed."""

    def __init__(self, inner: torch.optim.Optimizer, **parts: Any) -> None:
        self.optimizer = inner
        self.state: dict[Any, Any] = {}  # the wrapper's own state is not where the moments live
        for name, value in parts.items():
            setattr(self, name, value)


def test_zero2_rank_counts_its_fp32_master_partition_and_gradient_partitions():
    # World 2: a bf16 64 x 64 weight (8,192 bytes) whole on every rank; this rank's fp32 master half (2,048 elements,
    # 8,192 bytes) is optimizer state with AdamW's two fp32 moments (16,384) and step (4); its fp32 .grad (8,192) and
    # the bf16 grads_in_partition (4,096) are gradients.
    layer = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    master = torch.zeros(2048, requires_grad=True)
    inner = torch.optim.AdamW([master], lr=1e-3)
    master.grad = torch.ones(2048)
    inner.step()
    zero = _ZeroOptimizer(
        inner, single_partition_of_fp32_groups=[master], grads_in_partition=torch.zeros(2048, dtype=torch.bfloat16)
    )
    mb = memory_breakdown(layer, [zero], compute_device="cpu")
    assert (mb.params.device, mb.grads.device, mb.optimizer_states.device) == (8192, 8192 + 4096, 8192 + 16_384 + 4)
    # Under optimizer offload the same bytes are the CPU's; the weights stay on the device.
    off = memory_breakdown(layer, [zero], compute_device="cpu", offload={"optimizer_states": "cpu"})
    assert (off.params.device, off.grads.cpu, off.optimizer_states.cpu) == (8192, 12_288, 24_580)
    assert off.grads.device == off.optimizer_states.device == 0


def test_zero3_rank_counts_its_parameter_partitions_and_the_gathered_small_ones():
    # World 4: the 64 x 64 weight is released (an empty tensor) and this rank holds 1,024 bf16 elements of it; the
    # 64-element bias is below the persistence threshold, so it stays gathered beside its 16-element partition.
    layer = torch.nn.Linear(64, 64).to(torch.bfloat16)
    layer.weight.data = torch.empty(0, dtype=torch.bfloat16)
    layer.weight.ds_tensor = torch.zeros(1024, dtype=torch.bfloat16)
    layer.bias.ds_tensor = torch.zeros(16, dtype=torch.bfloat16)
    masters = torch.zeros(1040, requires_grad=True)  # fp32_partitioned_groups_flat: 1,024 + 16 elements
    zero = _ZeroOptimizer(
        torch.optim.SGD([masters], lr=0.1),
        fp32_partitioned_groups_flat=[masters],
        grad_partitions_flat_buffer=torch.zeros(1040, dtype=torch.bfloat16),
    )
    mb = memory_breakdown(layer, [zero], compute_device="cpu")
    assert mb.params.device == 2 * 1024 + 2 * 16 + 2 * 64
    assert mb.grads.device == 2 * 1040
    assert mb.optimizer_states.device == 4 * 1040  # SGD without momentum keeps no state of its own
