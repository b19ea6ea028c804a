"""Model-state bytes: the design articles' arithmetic, and each implementation's real layout (incl. step temporaries,
reduce buckets and ZeRO-3's gathered parameters)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.planner import (
    OPTIMIZER_STATES,
    StrategyLayout,
    estimate_model_states,
    optimizer_state_model,
    textbook_model_state_bytes,
)

ADAMW = OPTIMIZER_STATES["adamw"]


def test_textbook_fp32_adam_10b_is_160_gb():
    tb = textbook_model_state_bytes(10_000_000_000, "fp32")
    assert (tb["params"], tb["grads"], tb["optimizer_states"]) == (40e9, 40e9, 80e9)
    assert tb["total"] == 160e9


def test_textbook_mixed_adamw_7b_is_112_gb_not_140_or_56():
    tb = textbook_model_state_bytes(7_000_000_000, "mixed")
    assert (tb["params"], tb["grads"], tb["optimizer_states"]) == (14e9, 14e9, 84e9)
    assert tb["total"] == 112e9
    # The articles' slips: optimizer states at 16 B/param (2+2+16) and Adam moments in 16 bits (2+2+4).
    assert tb["total"] not in (140e9, 56e9)


def test_textbook_rejects_unknown_scheme():
    with pytest.raises(ConfigError, match="scheme"):
        textbook_model_state_bytes(1, "fp8")


def test_lightning_fp32_and_amp_store_16_bytes_per_param_like_the_textbook():
    n = 10_000_000_000
    for precision in ("32-true", "bf16-mixed"):
        est = estimate_model_states([[n]], precision, StrategyLayout(), ADAMW, 1)
        # Lightning AMP keeps fp32 weights and grads: 4 + 4 + 8, plus torch's 4-byte step counter per tensor.
        assert est.per_device() == {
            "params": 4 * n,
            "grads": 4 * n,
            "optimizer_states": 8 * n + 4,
            "activations": 0,
            "other": 0,
            "total": 16 * n + 4,
        }


def test_bf16_true_keeps_states_in_bf16():
    est = estimate_model_states([[1000]], "bf16-true", StrategyLayout(), ADAMW, 1)
    assert est.bytes("params") == 2000
    assert est.bytes("grads") == 2000
    assert est.bytes("optimizer_states") == 4004


def test_ddp_adds_gradient_buckets_at_any_world_size():
    # DDP allocates its buckets on one rank too (measured: 4 B x params at world 1 with gloo); a single-device run
    # without the DDP preset is layout "single" and has none.
    one = estimate_model_states([[1000]], "32-true", StrategyLayout(kind="ddp"), ADAMW, 1)
    two = estimate_model_states([[1000]], "32-true", StrategyLayout(kind="ddp"), ADAMW, 2)
    single = estimate_model_states([[1000]], "32-true", StrategyLayout(kind="single"), ADAMW, 1)
    assert one.bytes("other") == 4000
    assert single.bytes("other") == 0
    assert two.bytes("other") == 4000
    assert two.bytes("params") == 4000  # replicated


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_bf16_zero12_layout(stage):
    n, w = 1_000_000, 4
    group = [1000] * 1000  # partition boundaries fall between parameters
    est = estimate_model_states([group], "bf16-mixed", StrategyLayout(kind="deepspeed", zero_stage=stage), ADAMW, w)
    part = n // w
    assert est.bytes("params") == 2 * n  # flat bf16 weights, not partitioned in ZeRO-1/2
    assert est.bytes("grads") == 2 * part + 4 * part  # half partition + fp32 partition of the step
    accumulating = estimate_model_states(
        [group], "bf16-mixed", StrategyLayout(kind="deepspeed", zero_stage=stage), ADAMW, w, accumulate=4
    )
    # Between accumulation boundaries ZeRO-1 keeps full half .grad; ZeRO-2 reduces every micro-batch.
    assert accumulating.bytes("grads") - est.bytes("grads") == (2 * n if stage == 1 else 0)
    assert est.bytes("optimizer_states") == 4 * part + 8 * part + 4  # master + m + v (+ step)


def test_deepspeed_pads_flat_buffer_to_twice_world():
    est = estimate_model_states([[1001]], "bf16-mixed", StrategyLayout(kind="deepspeed", zero_stage=2), ADAMW, 4)
    assert est.bytes("params") == 2 * 1008  # ceil(1001 / 8) * 8


def test_zero3_partitions_each_param_and_keeps_small_ones_whole():
    layout = StrategyLayout(kind="deepspeed", zero_stage=3, param_persistence_threshold=100)
    est = estimate_model_states([[1000, 10]], "bf16-mixed", layout, ADAMW, 2)
    part = 500 + 5
    assert est.bytes("params") == 2 * part + 2 * 10
    assert est.bytes("grads") == 2 * part + 4 * part
    assert est.bytes("optimizer_states") == 4 * part + 8 * part + 4


def test_zero3_fp32_clones_an_fp32_master_partition_too():
    # stage3.py _create_fp32_partitions skips the clone only when `tensor.device == self.device`, a torch.device
    # against a string: never equal, so fp32 models get the copy as well (12 B/param/world measured).
    est = estimate_model_states([[1000]], "32-true", StrategyLayout(kind="deepspeed", zero_stage=3), ADAMW, 2)
    assert est.bytes("optimizer_states") == 4 * 500 + 8 * 500 + 4
    # The fp32 gradient partition is flattened into a new tensor inside step(), fp32 or not.
    assert est.bytes("grads") - est.bytes("grads", resident_only=True) == 4 * 500


def test_zero3_fp32_gpt_125m_optimizer_states_match_the_measured_2_process_figure():
    from lightning_trainopt.metrics.model_shape import GPTConfig
    from lightning_trainopt.planner import gpt_param_groups

    cfg = GPTConfig(
        name="gpt_125m", vocab_size=50304, n_layers=12, d_model=768, n_heads=12, ffn_hidden=2048, max_seq_len=2048
    )
    layout = StrategyLayout(kind="deepspeed", zero_stage=3)
    est = estimate_model_states(gpt_param_groups(cfg), "32-true", layout, ADAMW, 2)
    # Measured: 741,523,976 B on rank 0 of a 2-process run; the planner said 494,349,316 before.
    assert est.bytes("optimizer_states") == 741_523_976


def test_zero3_in_step_fp32_gradient_is_one_sub_group_at_a_time():
    layout = StrategyLayout(kind="deepspeed", zero_stage=3)
    est = estimate_model_states([[1000], [10]], "bf16-mixed", layout, ADAMW, 2)
    in_step = [t for t in est.terms if t.category == "grads" and t.phase == "in_step"]
    # _release_sub_group drops each sub-group's fp32 gradient after its step: the largest one, not the sum.
    assert [t.nbytes for t in in_step] == [4 * 500]


def test_offload_moves_optimizer_and_fp32_grads_to_cpu():
    layout = StrategyLayout(kind="deepspeed", zero_stage=2, offload_optimizer="cpu")
    est = estimate_model_states([[1000]], "bf16-mixed", layout, OPTIMIZER_STATES["deepspeed_cpu_adam"], 2)
    assert est.bytes("optimizer_states") == 0
    assert est.bytes("optimizer_states", "cpu") == 4 * 500 + 8 * 500
    assert est.bytes("grads", "cpu") == 4 * 500
    assert est.bytes("params") == 2000
    # No half gradient partition on the device (DeepSpeed never allocates grads_in_partition under offload),
    # only a staging buffer the size of the largest parameter; a bf16 copy of the partition lives on the CPU.
    assert est.bytes("grads") == 0
    # staging buffer + two reduce buckets of reduce_bucket_size (offload forces contiguous_gradients; overlap_comm)
    assert est.bytes("other") == 2 * 1000 + 2 * 2 * 200_000_000
    assert est.bytes("other", "cpu") == 2 * 500


def test_offload_with_accumulation_parks_half_gradients_on_cpu():
    layout = StrategyLayout(kind="deepspeed", zero_stage=2, offload_optimizer="cpu")
    est = estimate_model_states(
        [[600, 400]], "bf16-mixed", layout, OPTIMIZER_STATES["deepspeed_cpu_adam"], 2, accumulate=4
    )
    # Rank 1's partition [500, 1000) touches the 600-element parameter (from 0) and the 400 one: both whole.
    assert est.bytes("grads", "cpu") == 4 * 500 + 2 * 1000
    assert est.bytes("grads") == 0


CPU_ADAM = OPTIMIZER_STATES["deepspeed_cpu_adam"]
INFINITY = StrategyLayout(
    kind="deepspeed", zero_stage=3, offload_optimizer="nvme", offload_params="nvme", param_persistence_threshold=0
)
# Rank partitions (world 2): a 300,500-element decay group (swapped: >= 1 MiB of fp32) and a 32-element one (not).
GROUPS = [[600_000, 1000], [64]]


def _terms(est, location):
    return {t.label: t.nbytes for t in est.terms if t.location == location}


def test_infinity_keeps_pinned_swap_buffers_and_the_weights_in_host_ram():
    est = estimate_model_states(GROUPS, "bf16-mixed", INFINITY, CPU_ADAM, 2)
    cpu = _terms(est, "cpu")
    # Lightning's defaults: 4 fp32 optimizer buffers of the largest sub-group (1 KiB-aligned: 300,544), 5 parameter
    # buffers of 1e8 bf16 elements (1 KiB-aligned: 100,000,256); max_in_cpu 1e9 holds every weight partition.
    assert cpu["optimizer swap buffers (pinned)"] == 4 * 4 * 300_544
    assert cpu["parameter swap buffers (pinned)"] == 5 * 2 * 100_000_256
    assert cpu["16-bit weight partitions, CPU flat buffers (max_in_cpu)"] == 2 * (300_500 + 32)
    assert cpu["16-bit gradient partitions"] == 2 * (300_500 + 32)
    # The 32-element sub-group is never swapped: master, moments and fp32 gradient stay on the CPU.
    assert cpu["fp32 master partition (sub-groups < 1 MiB)"] == 4 * 32
    assert cpu["DeepSpeedCPUAdam (sub-groups < 1 MiB)"] == 8 * 32
    assert cpu["fp32 gradient buffer (sub-groups < 1 MiB)"] == 4 * 32
    assert cpu["DeepSpeedCPUAdam before its first swap-out (first step)"] == 8 * 300_500
    assert "parameter swap-out reuse buffer (pinned)" not in cpu
    assert est.bytes("params", "nvme") == 0
    assert est.bytes("grads", "nvme") == est.bytes("optimizer_states", "nvme") // 3 == 4 * 300_500
    # Both partitions of the swapped group stay as fp32 copies: 300,000 is not a multiple of 256, 500 is < 1 MiB.
    assert _terms(est, "device")["fp32 gradients too small or unaligned to swap"] == 4 * 300_500
    assert est.bytes(location="cpu", resident_only=True) == sum(cpu.values()) - 8 * 300_500


def test_infinity_puts_what_max_in_cpu_leaves_out_on_nvme_and_reserves_a_reuse_buffer():
    layout = replace(INFINITY, max_in_cpu=1000, optimizer_buffer_count=5, params_buffer_count=2, params_buffer_size=10)
    est = estimate_model_states(GROUPS, "32-true", layout, CPU_ADAM, 2)
    cpu = _terms(est, "cpu")
    # Group 1 gets a 1,000-element buffer its 300,500-element sub-group does not fit in; group 2 gets none
    # (torch.empty(1)): both sub-groups live on NVMe.
    assert cpu["32-bit weight partitions, CPU flat buffers (max_in_cpu)"] == 4 * (1000 + 1)
    assert est.bytes("params", "nvme") == 4 * (300_500 + 32)
    # Sized by the full parameters of the largest sub-group, each 1 KiB-aligned (256 fp32 elements).
    assert cpu["parameter swap-out reuse buffer (pinned)"] == 4 * (600_064 + 1024)
    assert cpu["parameter swap buffers (pinned)"] == 2 * 4 * 256
    assert cpu["optimizer swap buffers (pinned)"] == 5 * 4 * 300_544


def test_sub_group_size_splits_a_group_and_sizes_the_optimizer_buffers():
    layout = replace(INFINITY, sub_group_size=200_000)
    est = estimate_model_states([[600_000, 600_000]], "bf16-mixed", layout, CPU_ADAM, 2)
    assert _terms(est, "cpu")["optimizer swap buffers (pinned)"] == 4 * 4 * 300_032
    assert _terms(est, "cpu")["DeepSpeedCPUAdam before its first swap-out (first step)"] == 8 * 300_000


def test_zero3_cpu_offload_of_an_fp32_model_keeps_two_gradient_partitions():
    layout = StrategyLayout(kind="deepspeed", zero_stage=3, offload_optimizer="cpu", offload_params="cpu")
    est = estimate_model_states([[1000]], "32-true", layout, CPU_ADAM, 2)
    # grad_partitions_flat_buffer (model dtype) and the sub-group's own fp32 gradient buffer.
    assert est.bytes("grads", "cpu") == 4 * 500 + 4 * 500


def test_fsdp_shards_everything():
    est = estimate_model_states([[1000]], "bf16-mixed", StrategyLayout(kind="fsdp"), ADAMW, 4)
    assert sum(est.bytes(c) for c in ("params", "grads", "optimizer_states")) == 16 * 250 + 4


def test_8bit_optimizer_quantizes_only_large_tensors():
    bnb = optimizer_state_model("bitsandbytes.optim.AdamW8bit")
    big, small = 8192, 100
    assert bnb.bytes_for([big], 4) == 2 * (big + 4 * big // 256)
    assert bnb.bytes_for([small], 2) == 2 * 4 * small  # fp32 states below min_8bit_size
    assert optimizer_state_model("torchao.optim.AdamW4bit").bytes_for([256], 4) == 4 + 2 * 256 * 4


def test_unknown_optimizer_is_refused_with_the_key():
    with pytest.raises(ConfigError, match="optimizer._target_"):
        optimizer_state_model("my.Shampoo")


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"kind": "ddp", "offload_params": "cpu"}, IncompatibleConfigError),
        ({"kind": "deepspeed", "zero_stage": 2, "offload_optimizer": "nvme"}, IncompatibleConfigError),
        ({"kind": "deepspeed", "zero_stage": 4}, ConfigError),
        ({"kind": "megatron"}, ConfigError),
    ],
)
def test_bad_layouts_raise(kwargs, err):
    with pytest.raises(err):
        StrategyLayout(**kwargs)


def test_world_size_must_be_positive():
    with pytest.raises(ConfigError, match="trainer.devices"):
        estimate_model_states([[1]], "32-true", StrategyLayout(), ADAMW, 0)


def test_zero2_gradient_partition_counts_params_touching_the_partition_whole():
    # Flat [2 | 2 | 12] over 2 ranks: partitions [0, 8) and [8, 16); the 12-element param straddles both.
    layout = StrategyLayout(kind="deepspeed", zero_stage=2)
    by_rank = [
        estimate_model_states([[2, 2, 12]], "bf16-mixed", layout, ADAMW, 2, rank=r).bytes("grads", resident_only=True)
        for r in (0, 1, None)
    ]
    assert by_rank == [2 * 16, 2 * 12, 2 * 16]  # rank 0 holds all three, rank 1 only the straddler; None = worst


def test_transient_terms_are_in_the_peak_but_not_resident():
    layout = StrategyLayout(kind="deepspeed", zero_stage=2)
    est = estimate_model_states([[1000]], "bf16-mixed", layout, ADAMW, 2)
    assert est.bytes("grads") - est.bytes("grads", resident_only=True) == 4 * 500  # fp32 partition inside step()


# ---------------------------------------------------------------- optimizer-step temporaries (torch/optim/adam.py)


def _temps(est):
    return {t.label: t.nbytes for t in est.terms if t.phase == "in_step" and t.category == "other"}


@pytest.mark.parametrize(("stage", "threshold"), [(1, 100_000), (2, 100_000), (3, 0)])
def test_deepspeed_foreach_adam_makes_a_temporary_the_size_of_the_fp32_partition(stage, threshold):
    layout = StrategyLayout(
        kind="deepspeed", zero_stage=stage, param_persistence_threshold=threshold, reduce_bucket_size=100
    )
    groups = [[4000, 4000], [8]]
    fused = estimate_model_states(groups, "bf16-mixed", layout, ADAMW, 2, adam_path="fused")
    foreach = estimate_model_states(groups, "bf16-mixed", layout, ADAMW, 2, adam_path="foreach")
    single = estimate_model_states(groups, "bf16-mixed", layout, ADAMW, 2, adam_path="single_tensor")
    # The client AdamW steps one group's flat fp32 partition at a time: group 0 holds 8000 / 2 elements per rank.
    assert _temps(fused) == {}
    assert sum(_temps(foreach).values()) == 4 * 4000
    assert sum(_temps(single).values()) == 2 * 4 * 4000  # sqrt and the quotient coexist on the CPU path
    assert foreach.bytes("other") - fused.bytes("other") == 4 * 4000
    assert foreach.bytes("other", resident_only=True) == fused.bytes("other", resident_only=True)


def test_offloaded_optimizer_makes_no_device_temporary():
    layout = StrategyLayout(kind="deepspeed", zero_stage=2, offload_optimizer="cpu")
    est = estimate_model_states(
        [[4000]], "bf16-mixed", layout, OPTIMIZER_STATES["deepspeed_cpu_adam"], 2, adam_path="foreach"
    )
    assert _temps(est) == {}


def test_fsdp_temporary_is_per_shard_and_absent_with_the_fused_kernel():
    groups = [[4000, 2000]]
    lay = StrategyLayout(kind="fsdp")
    assert _temps(estimate_model_states(groups, "bf16-mixed", lay, ADAMW, 4, adam_path="fused")) == {}
    foreach = estimate_model_states(groups, "bf16-mixed", lay, ADAMW, 4, adam_path="foreach")
    single = estimate_model_states(groups, "bf16-mixed", lay, ADAMW, 4, adam_path="single_tensor")
    assert sum(_temps(foreach).values()) == 4 * (1000 + 500)  # all shards of the group at once
    assert sum(_temps(single).values()) == 2 * 4 * 1000  # the largest shard, two temporaries


def test_ddp_single_tensor_temporary_follows_the_largest_tensor_in_its_dtype():
    est = estimate_model_states([[3000, 10], [5]], "bf16-true", StrategyLayout(), ADAMW, 1, adam_path="single_tensor")
    assert sum(_temps(est).values()) == 2 * 2 * 3000  # bf16 states: zeros_like(param)


def test_8bit_optimizer_makes_no_adam_temporary():
    layout = StrategyLayout(kind="deepspeed", zero_stage=2)
    est = estimate_model_states([[8192]], "bf16-mixed", layout, OPTIMIZER_STATES["adamw8bit"], 2, adam_path="foreach")
    assert _temps(est) == {}


def test_unknown_adam_path_is_refused():
    with pytest.raises(ConfigError, match="adam_path"):
        estimate_model_states([[1]], "32-true", StrategyLayout(), ADAMW, 1, adam_path="turbo")


# ---------------------------------------------------------------- DeepSpeed reduce buckets and ZeRO-3 gathering


@pytest.mark.parametrize(("overlap", "copies"), [(True, 2), (False, 1)])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_reduce_buckets_are_full_size_and_double_with_overlap_comm(stage, overlap, copies):
    layout = StrategyLayout(kind="deepspeed", zero_stage=stage, reduce_bucket_size=50_000_000, overlap_comm=overlap)
    est = estimate_model_states([[1000]], "bf16-mixed", layout, ADAMW, 2)
    buckets = [t for t in est.terms if t.label.startswith("reduce bucket")]
    # torch.empty(int(reduce_bucket_size)) per buffer, whatever the model size (stage_1_and_2.py setup_buckets)
    assert [(t.nbytes, t.phase) for t in buckets] == [(copies * 2 * 50_000_000, "backward")]


def test_zero3_keeps_one_reduce_bucket_and_the_gathered_working_set():
    layout = StrategyLayout(
        kind="deepspeed",
        zero_stage=3,
        reduce_bucket_size=1000,
        param_persistence_threshold=100,
        prefetch_bucket_size=0,
        max_reuse_distance=0,
    )
    est = estimate_model_states([[4000, 3000, 10]], "bf16-mixed", layout, ADAMW, 2)
    other = {t.label: (t.nbytes, t.phase) for t in est.terms if t.category == "other"}
    assert other["reduce bucket"] == (2 * 1000, "all")
    # No prefetch, no reuse: one parameter gathered at a time, the largest; its full gradient before the reduce.
    assert other["gathered params (fetched + prefetched + kept for reuse)"] == (2 * 4000, "backward")
    assert other["full gradient of one param before its reduce"] == (2 * 4000, "backward")
