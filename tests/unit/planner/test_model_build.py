"""The build phase: what a rank holds while the model is built, compared with (never added to) the step's peak."""

from __future__ import annotations

from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import PlanInputs, StrategyLayout, estimate_plan
from lightning_trainopt.planner.activations import ActivationPolicy
from lightning_trainopt.planner.terms import MemoryEstimate, Term

GIB = 2**30
LLAMA_13B = GPTConfig(
    name="llama_13b", vocab_size=32000, n_layers=40, d_model=5120, n_heads=40, ffn_hidden=13824, max_seq_len=4096,
    tie_embeddings=False,
)  # fmt: skip
ZERO2_OFFLOAD = StrategyLayout(
    "zero2_offload", "deepspeed", 2, offload_optimizer="cpu", reduce_bucket_size=50_000_000, buckets_sized_to_model=True
)


def _plan(layout: StrategyLayout, devices: int, memory_gib: float, precision: str = "bf16-mixed", host=None):
    inputs = PlanInputs(
        LLAMA_13B, precision, layout, activations=ActivationPolicy(checkpoint_every=1), seq_len=2048, devices=devices
    )
    return estimate_plan(inputs, int(memory_gib * GIB), 312e12, 1.0, headroom_fraction=0.05, host_memory_bytes=host)


def test_build_terms_are_compared_with_the_step_not_added_to_it():
    est = MemoryEstimate(
        (
            Term("params", "device", "w", 100),
            Term("activations", "device", "a", 50, phase="backward"),
            Term("params", "device", "built", 120, phase="build"),
        )
    )
    assert est.bytes() == 150  # a step's bytes only
    assert est.build_bytes() == 120
    assert est.peak() == 150
    assert MemoryEstimate((*est.terms, Term("params", "device", "fp32 build", 200, phase="build"))).peak() == 320


def test_zero2_offload_llama_13b_is_built_at_2_bytes_per_param_and_the_plan_says_so():
    e = _plan(ZERO2_OFFLOAD, 8, 40)
    n = LLAMA_13B.n_params()
    # LitGPT builds in bf16 under DeepSpeed: 24.2 GiB, not the 48.5 GiB of an fp32 build.
    assert e.memory.build_bytes() == 2 * n
    assert 24 * GIB < e.memory.build_bytes() < 25 * GIB
    assert e.peak_device_bytes >= e.memory.build_bytes()
    assert e.fits


def test_zero3_builds_partitions_plus_one_block_gathered():
    # ZeRO-3 re-runs the init a module at a time (parallel/deepspeed.py): the largest gather is one block
    # (12 x 5120^2-ish = 0.32e9 elements) or the embedding (32000 x 5120), never the whole model.
    zero3 = StrategyLayout("zero3", "deepspeed", 3, reduce_bucket_size=50_000_000, buckets_sized_to_model=True)
    e = _plan(zero3, 64, 24)
    d, f = LLAMA_13B.d_model, LLAMA_13B.ffn_hidden
    block = 4 * d * d + 3 * d * f + 2 * d
    n = LLAMA_13B.n_params()
    gathered = [t for t in e.memory.terms if t.phase == "build" and "gathered" in t.label]
    assert [t.nbytes for t in gathered] == [2 * max(block, LLAMA_13B.vocab_size * d)]
    assert e.memory.build_bytes() < 2 * n / 64 + 2 * block + GIB
    assert e.device_fits is True


def test_fsdp_builds_on_the_meta_device_so_a_rank_holds_its_shards_and_one_whole_parameter():
    fsdp = StrategyLayout("fsdp", "fsdp")
    e = _plan(fsdp, 8, 80, host=384 * GIB)
    n = LLAMA_13B.n_params()
    embedding = LLAMA_13B.vocab_size * LLAMA_13B.d_model  # the largest parameter (lm_head is as large)
    # fp32 under bf16-mixed: one whole parameter in host memory at a time, never the model (4 B x 13e9 = 48 GiB).
    assert e.memory.build_bytes("cpu") == 4 * embedding
    assert e.host_fits is True
    shards = [t for t in e.memory.terms if t.phase == "build" and t.label == "this rank's shards"]
    assert len(shards) == 1
    assert shards[0].location == "device"
    assert 4 * n / 8 <= shards[0].nbytes < 4 * n / 8 + GIB
    # Under CPUOffloadPolicy the shards are built in host memory.
    offload = StrategyLayout("fsdp_offload", "fsdp", offload_optimizer="cpu", offload_params="cpu")
    assert _plan(offload, 8, 80, host=384 * GIB).memory.build_bytes("cpu") == 4 * embedding + shards[0].nbytes
