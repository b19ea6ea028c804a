"""Per-rank bytes of parameters, gradients and optimizer states, as each implementation really stores them.

Sources read for every rule (deepspeed 0.19, lightning 2.6, torch 2.13):

- Lightning AMP (``bf16-mixed``/``16-mixed``) keeps fp32 weights and fp32 ``.grad``; autocast makes half copies
  on the fly (counted with activations, they are saved for backward). ``*-true`` stores everything in the half dtype,
  and torch optimizers allocate ``zeros_like(param)`` states, so in the half dtype too.
- DDP (``gradient_as_bucket_view=False``, Lightning's default) keeps gradient buckets the size of all gradients.
- DeepSpeed ZeRO-1/2 (``stage_1_and_2.py``): a flat half-precision copy of all weights, padded to a multiple of
  ``2 x world``; an fp32 master partition (``single_partition_of_fp32_groups``, a ``.clone().float()`` even in fp32);
  optimizer moments on that partition; the fp32 gradient partition built in ``step``. Both reduce gradients into
  ``grads_in_partition`` (every parameter touching the rank's 1/world slice, whole) as they are produced — ZeRO-1
  only at the accumulation boundary, keeping full half ``param.grad`` in between.
- DeepSpeed ZeRO-3 (``stage3.py``): every parameter partitioned on its own (``ceil(numel / world)``); parameters
  of at most ``param_persistence_threshold`` elements also stay gathered on every rank; gradient partitions in
  ``gradient_accumulation_dtype`` (the model dtype); an fp32 master copy per sub-group, fp32 models included (its
  skip compares a ``torch.device`` with a string); in ``step()`` each sub-group's gradients flattened into fp32.
- FSDP2 (``fully_shard``): parameters, gradients and optimizer states sharded by world size in the parameters' dtype;
  the units it holds unsharded during backward: ``fsdp_units.py``.
- Every strategy: what a rank holds while the model is built, before the first step: ``model_build.py``.
- torch Adam/AdamW inside ``step()`` (``torch/optim/adam.py``): the fused kernel makes no temporary; the multi-tensor
  path (CUDA default when not fused) makes ``_foreach_sqrt(exp_avg_sqs)``, one temporary per state tensor of the
  param group being stepped; the single-tensor path (CPU) makes ``exp_avg_sq.sqrt()`` and its quotient, two
  temporaries of one tensor at a time. DeepSpeed steps the client optimizer on each group's flat fp32 partition
  (``_optimizer_step(i)``), so there the "tensor" is the whole partition of a group.
- ZeRO-Infinity (``swap_tensor/*.py``, ``stage3.py``): NVMe offload keeps pinned host buffers. Optimizer swap:
  ``buffer_count`` fp32 buffers of the largest sub-group partition (``SwapBufferManager``); sub-groups under 1 MiB
  of fp32 are never swapped and stay on the CPU like CPU offload. Parameter swap: ``buffer_count x buffer_size``
  elements of the model dtype (``AsyncPartitionedParameterSwapper``), a flat CPU buffer per param group holding up to
  ``max_in_cpu`` partition elements in all (``_create_param_groups_fp16_flat_cpu_memory``), and a reuse buffer the
  full size of the largest sub-group's parameters when some sub-group is left on NVMe
  (``reserve_partitioned_swap_space``). Under any optimizer offload the half gradient partitions
  (``grad_partitions_flat_buffer``) are on the CPU.
- DeepSpeed reduce buckets: ZeRO-1/2 with ``contiguous_gradients`` allocate ``reduce_bucket_size`` elements of the
  model dtype per buffer, two with ``overlap_comm`` (``setup_buckets``), at the first gradient hook of a backward, and
  drop them at its end (``independent_gradient_partition_epilogue`` -> ``_release_ipg_buffers`` and
  ``_clear_param_grad_only``); ZeRO-3 allocates one such buffer at start-up and keeps it (``stage3.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.fsdp_units import FSDPUnits
from lightning_trainopt.planner.model_build import build_terms
from lightning_trainopt.planner.optimizer_state import OptimizerStateModel
from lightning_trainopt.planner.strategy_layout import MODEL_SIZED_BUCKET_CAP, StrategyLayout, model_sized_bucket
from lightning_trainopt.planner.terms import MemoryEstimate, Term
from lightning_trainopt.planner.terms import numel_text as _gb
from lightning_trainopt.planner.zero3_gather import zero3_gathered_peak_numel
from lightning_trainopt.planner.zero_infinity import nvme_optimizer_terms, nvme_param_terms, zero3_sub_groups

__all__ = [
    "ADAM_PATHS",
    "MODEL_SIZED_BUCKET_CAP",
    "StrategyLayout",
    "estimate_model_states",
    "model_sized_bucket",
    "param_dtype_bytes",
]

#: How torch Adam/AdamW runs its step: ``fused`` kernel, ``foreach`` (multi-tensor) or ``single_tensor`` loop.
ADAM_PATHS = ("fused", "foreach", "single_tensor")
ModuleTrace = tuple[tuple[tuple[int, int], ...], ...]


def param_dtype_bytes(trainer_precision: str, layout: StrategyLayout) -> tuple[int, int]:
    """(weight bytes, gradient bytes) per element as the strategy stores the model's own parameters."""
    half = trainer_precision.startswith(("bf16", "16")) or trainer_precision == "transformer-engine"
    if layout.wraps_in_engine:
        # Lightning hands DeepSpeed `bf16`/`fp16` enabled for both -mixed and -true: the engine casts the module.
        return (2, 2) if half else (4, 4)
    if trainer_precision.endswith("-true") and half:
        return 2, 2
    return 4, 4


def _where(place: str) -> str:
    return "device" if place == "none" else place


def estimate_model_states(
    param_groups: Sequence[Sequence[int]],
    trainer_precision: str,
    layout: StrategyLayout,
    optimizer: OptimizerStateModel,
    world_size: int,
    rank: int | None = None,
    accumulate: int = 1,
    adam_path: str = "fused",
    module_trace: ModuleTrace | None = None,
    fsdp_units: FSDPUnits | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer states, and what a rank holds while the model is built.

    Args:
        param_groups: element counts of the trainable parameters, one list per optimizer param group
            (each shared parameter once), e.g. ``[[4096 * 4096, ...], [4096, ...]]``.
        trainer_precision: Lightning's precision string (``32-true``, ``bf16-mixed``, ...).
        layout: the strategy.
        optimizer: how the optimizer stores its state.
        world_size: data-parallel ranks (devices x nodes).
        rank: the rank to account where ranks differ (ZeRO-2 gradient partitions); ``None``: the worst rank.
        accumulate: gradient accumulation steps; above 1, gradients live through the next forward too.
        adam_path: how a torch Adam/AdamW runs its step (one of :data:`ADAM_PATHS`): ``fused`` makes no temporary,
            ``foreach`` one as large as the second moments of the group stepped, ``single_tensor`` two as large as
            one state tensor at a time. Ignored for other optimizers and under optimizer offload (DeepSpeed CPU Adam).
        module_trace: forward order of the parameter-owning modules (``zero3_gather.gpt_module_trace``), for the
            parameters ZeRO-3 holds gathered; ``None``: each parameter its own module, in ``param_groups`` order.
        fsdp_units: FSDP2's units (``fsdp_units.gpt_fsdp_units``), for the parameters and gradients it holds
            unsharded; ``None``: each parameter its own unit.

    Raises:
        ConfigError: ``world_size`` below 1, unknown ``adam_path``.
    """
    if world_size < 1:
        raise ConfigError("trainer.devices", world_size, "plan for at least one device.")
    if adam_path not in ADAM_PATHS:
        raise ConfigError("adam_path", adam_path, f"use one of {', '.join(ADAM_PATHS)}.")
    w = world_size
    numels = [n for g in param_groups for n in g]
    n = sum(numels)
    wb, gb = param_dtype_bytes(trainer_precision, layout)
    grad_phase = "step" if accumulate == 1 else "all"
    units = fsdp_units or FSDPUnits.per_parameter(numels)
    largest_unit = max((*units.blocks, units.root), default=0)
    built = build_terms(numels, wb, layout, w, largest_unit, largest_gather=max((*units.blocks, *numels), default=0))
    terms: list[Term | None] = list(built)
    if not layout.shards_optimizer:
        terms.append(Term("params", "device", f"{8 * wb}-bit weights", wb * n, f"{wb} B x {_gb(n)}"))
        terms.append(Term("grads", "device", f"{8 * gb}-bit .grad", gb * n, f"{gb} B x {_gb(n)}", phase=grad_phase))
        terms.append(_adam_temporary(optimizer, adam_path, [list(g) for g in param_groups], wb, "device"))
        terms.append(
            Term("optimizer_states", "device", optimizer.name, optimizer.bytes_for(numels, wb), optimizer.formula(wb))
        )
        if layout.ddp_buckets:
            # Lightning wraps the model in DDP even on one device, and DDP allocates its buckets at any world size.
            terms.append(Term("other", "device", "DDP gradient buckets", gb * n, f"{gb} B x {_gb(n)}"))
        return MemoryEstimate.of(t for t in terms if t is not None)
    if layout.shards_each_param:
        shards = [math.ceil(k / w) for k in numels]
        s = sum(shards)
        where = _where(layout.offload_params)
        terms.append(Term("params", where, f"{8 * wb}-bit weight shards", wb * s, f"{wb} B x {_gb(n)} / {w}"))
        terms.append(
            Term("grads", where, f"{8 * gb}-bit gradient shards", gb * s, f"{gb} B x {_gb(n)} / {w}", phase=grad_phase)
        )
        terms.append(
            Term("optimizer_states", where, optimizer.name, optimizer.bytes_for(shards, wb), optimizer.formula(wb))
        )
        shard_groups = [[math.ceil(k / w) for k in g] for g in param_groups]
        terms.append(_adam_temporary(optimizer, adam_path, shard_groups, wb, where))
        terms.extend(units.gathered_terms(wb, gb, layout.reshard_after_forward))
        return MemoryEstimate.of(t for t in terms if t is not None)
    trace = module_trace or tuple(((i, k),) for i, k in enumerate(numels))
    states = _deepspeed(param_groups, numels, n, wb, layout, optimizer, w, rank, accumulate, adam_path, trace)
    return MemoryEstimate.of(built) + states


def _adam_temporary(
    optimizer: OptimizerStateModel, adam_path: str, groups: Sequence[Sequence[int]], param_bytes: int, where: str
) -> Term | None:
    """The temporaries torch Adam/AdamW makes inside ``step()`` (``torch/optim/adam.py``), or ``None``.

    ``groups`` are the tensors the optimizer steps, one list per param group (DeepSpeed: one flat partition each).
    """
    if optimizer.name not in ("adam", "adamw") or adam_path == "fused":
        return None  # torch Adam/AdamW only: 8-bit kernels and DeepSpeed's CPU Adam update in place
    s = optimizer.state_dtype_bytes or param_bytes
    if adam_path == "foreach":
        # _foreach_sqrt(exp_avg_sqs): one new tensor per state of the param group being stepped (_multi_tensor_adam).
        big = max((sum(g) for g in groups), default=0)
        return Term("other", where, "Adam foreach sqrt temporary", s * big, f"{s} B x {_gb(big)}", phase="in_step")
    # exp_avg_sq.sqrt() / bias_correction2_sqrt: sqrt and quotient coexist, one tensor at a time (_single_tensor_adam).
    big = max((k for g in groups for k in g), default=0)
    return Term(
        "other", where, "Adam sqrt/div temporaries (largest tensor)", 2 * s * big, f"2 x {s} B x {_gb(big)}", "in_step"
    )


def _fp32_grad_partition(part: int, n: int, w: int, where: str) -> Term:
    """DeepSpeed's fp32 gradient partition: built inside ``step()`` on the device, kept for good under offload."""
    return Term(
        "grads",
        where,
        "fp32 gradient partition (step)",
        4 * part,
        f"4 B x {_gb(n)} / {w}",
        phase="in_step" if where == "device" else "all",
    )


def _params_in_partition_numel(group: Sequence[int], partition: int, rank: int) -> int:
    """Elements of the parameters that intersect ``rank``'s partition, counted whole (``get_partition_info``)."""
    start, end = rank * partition, (rank + 1) * partition
    total, offset = 0, 0
    for n in group:
        if start <= offset < end or offset < start < offset + n:
            total += n
        offset += n
    return total


def _deepspeed(
    param_groups: Sequence[Sequence[int]],
    numels: list[int],
    n: int,
    h: int,
    layout: StrategyLayout,
    optimizer: OptimizerStateModel,
    w: int,
    rank: int | None,
    accumulate: int,
    adam_path: str,
    trace: ModuleTrace,
) -> MemoryEstimate:
    terms: list[Term | None] = []
    opt_where = _where(layout.offload_optimizer)
    if not layout.shards_params:
        # Each param group is one flat buffer padded to a multiple of 2 x world (nccl_start_alignment_factor).
        nonempty = [g for g in param_groups if sum(g)]
        padded = [math.ceil(sum(g) / (2 * w)) * 2 * w for g in nonempty]
        parts = [p // w for p in padded]
        part = sum(parts)
        terms.append(Term("params", "device", f"{8 * h}-bit flat weights", h * sum(padded), f"{h} B x {_gb(n)}"))
        # grads_in_partition holds every parameter that touches this rank's partition, whole (ZeRO-1 and -2 alike
        # in deepspeed 0.19); report the worst rank (or the asked one).
        ranks = range(w) if rank is None else [rank]
        touched = max(sum(_params_in_partition_numel(g, p, r) for g, p in zip(nonempty, parts)) for r in ranks)
        largest = max(numels, default=0)
        if opt_where == "device":
            terms.append(
                Term(
                    "grads",
                    "device",
                    f"{8 * h}-bit gradient partition",
                    h * touched,
                    f"{h} B x {_gb(touched)} (params touching the 1/{w} partition)",
                )
            )
        else:
            # Under offload, grads_in_partition is never allocated: each reduced gradient is copied straight into
            # the CPU fp32 gradient partition (copy_grads_in_partition -> async_inplace_copy_grad_to_fp32_buffer_
            # from_gpu). What stays on the device is one staging buffer the size of the largest parameter.
            terms.append(
                Term(
                    "other",
                    "device",
                    "offload staging buffer (largest param)",
                    h * largest,
                    f"{h} B x {_gb(largest)}",
                )
            )
            terms.append(
                Term("other", opt_where, f"{8 * h}-bit CPU copy of the partition", h * part, f"{h} B x {_gb(n)} / {w}")
            )
            if accumulate > 1:
                # Between accumulation boundaries each gradient is parked in a CPU buffer of the whole parameter
                # (accumulated_grads_in_cpu), for every parameter touching the partition.
                terms.append(
                    Term(
                        "grads",
                        opt_where,
                        f"{8 * h}-bit CPU accumulation buffers",
                        h * touched,
                        f"{h} B x {_gb(touched)} (params touching the 1/{w} partition)",
                    )
                )
        if layout.reduces_at_boundary and accumulate > 1:
            # ZeRO-1 reduces (and frees) .grad only at the accumulation boundary (reduce_ready_partitions_and_remove_
            # grads); in between, full half gradients accumulate. ZeRO-2 reduces every micro-batch.
            terms.append(Term("grads", "device", f"{8 * h}-bit .grad between boundaries", h * n, f"{h} B x {_gb(n)}"))
        # Built in step() and freed at its end (stage_1_and_2.py), unless offload keeps a pinned CPU buffer.
        terms.append(_fp32_grad_partition(part, n, w, opt_where))
        terms.append(Term("optimizer_states", opt_where, "fp32 master partition", 4 * part, f"4 B x {_gb(n)} / {w}"))
        terms.append(
            Term("optimizer_states", opt_where, optimizer.name, optimizer.bytes_for(parts, 4), optimizer.formula(4))
        )
        if opt_where == "device":
            # The client optimizer steps group by group on the flat fp32 partition (one tensor per group).
            terms.append(_adam_temporary(optimizer, adam_path, [[p] for p in parts], 4, "device"))
        terms.append(_reduce_buckets(layout, h, n))
        return MemoryEstimate.of(t for t in terms if t is not None)
    shards = [math.ceil(k / w) for k in numels]
    part = sum(shards)
    persistent = sum(k for k in numels if k <= layout.param_persistence_threshold)
    subs = zero3_sub_groups(param_groups, w, layout.sub_group_size)
    if layout.offload_params == "nvme":
        terms.extend(nvme_param_terms(subs, w, h, layout))
    else:
        p_where = _where(layout.offload_params)
        terms.append(Term("params", p_where, f"{8 * h}-bit weight partitions", h * part, f"{h} B x {_gb(n)} / {w}"))
    terms.append(
        Term(
            "params",
            "device",
            "persistent small params (gathered through forward and backward)",
            h * persistent,
            f"{h} B x {_gb(persistent)} (<= {layout.param_persistence_threshold:,} elements each)",
            # The coordinator never releases them after a module (``__params_to_release`` skips ``ds_persist``), but
            # ``step()`` starts with ``_partition_all_parameters()``, which releases every parameter (deepspeed 0.19
            # stage3.py): they are gathered again in the next forward.
            phase="backward",
        )
    )
    # grad_partitions_flat_buffer lives on the optimizer's device: the CPU under any optimizer offload, NVMe included.
    g_where = "cpu" if opt_where == "nvme" else opt_where
    terms.append(Term("grads", g_where, f"{8 * h}-bit gradient partitions", h * part, f"{h} B x {_gb(n)} / {w}"))
    if layout.offload_optimizer == "nvme":
        terms.extend(nvme_optimizer_terms(subs, w, layout, optimizer))
    else:
        # The optimizer steps each sub-group's flat fp32 partition as one tensor (one `step` counter each).
        sub_parts = [sum(math.ceil(k / w) for k in sub) for group in subs for sub in group]
        if layout.offload_optimizer == "cpu":
            # Under offload each sub-group gets its own fp32 gradient buffer (initialize_optimizer_states), in fp32
            # models too, kept for good.
            terms.append(_fp32_grad_partition(part, n, w, opt_where))
        else:
            # _prepare_fp32_grad_for_sub_group flattens the sub-group's gradient partitions into a new tensor (then
            # .to(fp32)), in fp32 models too, and _release_sub_group drops it after that sub-group's step.
            largest = max(sub_parts, default=0)
            terms.append(
                Term(
                    "grads",
                    "device",
                    "fp32 gradient partition of one sub-group (step)",
                    4 * largest,
                    f"4 B x {_gb(largest)} (largest sub-group's partition)",
                    phase="in_step",
                )
            )
        # _create_fp32_partitions clones an fp32 master partition from the flat weight partition unless the two are
        # the same dtype *and* `tensor.device == self.device`; self.device is a string ("cuda:0", "cpu") and a
        # torch.device never equals a string, so the clone is made in fp32 models too (12 B/param/world with Adam).
        terms.append(Term("optimizer_states", opt_where, "fp32 master partition", 4 * part, f"4 B x {_gb(n)} / {w}"))
        terms.append(
            Term("optimizer_states", opt_where, optimizer.name, optimizer.bytes_for(sub_parts, 4), optimizer.formula(4))
        )
    if opt_where == "device":
        # One sub-group per param group (Lightning's sub_group_size 1e12): the optimizer steps each flat partition.
        group_parts = [sum(math.ceil(k / w) for k in g) for g in param_groups]
        terms.append(_adam_temporary(optimizer, adam_path, [[p] for p in group_parts], 4, "device"))
    if layout.contiguous_gradients:
        # stage3.py allocates the bucket once, after the optimizer states, on the device, and keeps it.
        bucket = layout.bucket_numel(n)
        terms.append(Term("other", "device", "reduce bucket", h * bucket, f"{h} B x {_bucket_formula(layout, n)}"))
    gathered = zero3_gathered_peak_numel(
        trace,
        layout.param_persistence_threshold,
        layout.prefetch_bucket_size,
        layout.max_live_parameters,
        layout.max_reuse_distance,
    )
    terms.append(
        Term(
            "other",
            "device",
            "gathered params (fetched + prefetched + kept for reuse)",
            h * gathered,
            f"{h} B x {_gb(gathered)} (replay of DeepSpeed's fetch/prefetch/reuse rules)",
            phase="backward",
        )
    )
    largest = max((k for k in numels if k > layout.param_persistence_threshold), default=0)
    terms.append(
        Term(
            "other",
            "device",
            "full gradient of one param before its reduce",
            h * largest,
            f"{h} B x {_gb(largest)} (largest param)",
            phase="backward",
        )
    )
    return MemoryEstimate.of(t for t in terms if t is not None)


def _bucket_formula(layout: StrategyLayout, n: int) -> str:
    size = layout.bucket_numel(n)
    if layout.buckets_sized_to_model:
        return f"reduce_bucket_size auto = min({layout.reduce_bucket_size:,}, N) = {size:,}"
    return f"reduce_bucket_size {size:,}"


def _reduce_buckets(layout: StrategyLayout, h: int, n: int) -> Term:
    """ZeRO-1/2 gradient-reduction buffers (``stage_1_and_2.py`` ``setup_buckets``), alive during backward."""
    if not (layout.contiguous_gradients or layout.offload_optimizer != "none"):
        # Without contiguous buffers each bucket's gradients are flattened into one transient of at most its size.
        bucket = min(layout.bucket_numel(n), n)
        return Term("other", "device", "reduce flatten", h * bucket, f"{h} B x min(reduce_bucket_size, N)", "backward")
    copies = 2 if layout.overlap_comm else 1
    size = layout.bucket_numel(n)
    return Term(
        "other",
        "device",
        f"reduce bucket{'s (double-buffered: overlap_comm)' if copies == 2 else ''}",
        copies * h * size,
        f"{copies} x {h} B x {_bucket_formula(layout, n)}",
        phase="backward",
    )


def textbook_model_state_bytes(n_params: int, scheme: str) -> dict[str, int]:
    """The design articles' per-parameter accounting (ZeRO paper, section 3.1), for the printed derivation.

    Args:
        n_params: parameter count.
        scheme: ``fp32`` (4 + 4 + 8 = 16 B: fp32 weights, grads, Adam m and v) or ``mixed`` (2 + 2 + 12 = 16 B:
            half weights and grads, fp32 master weights + m + v).

    Raises:
        ConfigError: unknown scheme.
    """
    per = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}
    if scheme not in per:
        raise ConfigError("scheme", scheme, "use fp32 or mixed.")
    w, g, o = per[scheme]
    return {
        "params": w * n_params,
        "grads": g * n_params,
        "optimizer_states": o * n_params,
        "total": (w + g + o) * n_params,
    }
