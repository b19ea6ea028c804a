"""ZeRO-Infinity's memory as DeepSpeed 0.19 allocates it: NVMe swap of parameters and optimizer states.

Sources: ``deepspeed/runtime/swap_tensor/*.py`` (``SwapBufferManager``, ``AsyncPartitionedParameterSwapper``,
``OptimizerSwapper``) and ``runtime/zero/stage3.py`` (``_create_fp16_sub_groups``,
``_create_param_groups_fp16_flat_cpu_memory``, ``reserve_partitioned_swap_space``). Each term is checked against the
buffers of a real run in ``tests/integration/test_planner_infinity.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.optimizer_state import OptimizerStateModel
from lightning_trainopt.planner.strategy_layout import StrategyLayout
from lightning_trainopt.planner.terms import Term
from lightning_trainopt.planner.terms import numel_text as _gb

__all__ = [
    "NVME_ADAM_BUFFERS",
    "check_optimizer_swap_buffers",
    "nvme_optimizer_terms",
    "nvme_param_terms",
    "zero3_sub_groups",
]

#: Pinned buffers ZeRO-Infinity's Adam takes at once to swap a sub-group in (``swap_in_optimizer_state``): the fp32
#: weights, both moments and the gradient. With fewer, ``SwapBufferManager.allocate`` returns ``None`` and the first
#: ``optimizer.step()`` fails on an assertion, after a whole forward and backward.
NVME_ADAM_BUFFERS = 4


def check_optimizer_swap_buffers(key: str, count: Any) -> None:
    """Refuse an optimizer NVMe-offload ``buffer_count`` DeepSpeed's Adam cannot step with (``key`` names it).

    Raises:
        ConfigError: ``count`` is not a whole number >= :data:`NVME_ADAM_BUFFERS`.
    """
    whole = not isinstance(count, bool) and isinstance(count, (int, float)) and count == int(count)
    if not whole or count < NVME_ADAM_BUFFERS:
        raise ConfigError(
            key,
            count,
            f"ZeRO-Infinity's Adam swaps {NVME_ADAM_BUFFERS} tensors of a sub-group in at once (fp32 weights, two "
            f"moments, gradient): use >= {NVME_ADAM_BUFFERS} (Lightning's default 4), and lower sub_group_size to "
            "shrink each buffer instead.",
        )


# DeepSpeed swaps only tensors of at least MIN_AIO_BYTES (and aio block_size, Lightning's default 1 MiB too), and
# aligns swap buffers to AIO_ALIGNED_BYTES (swap_tensor/utils.py, intra_op_parallelism 1).
_MIN_AIO_BYTES = 1024**2
_AIO_ALIGNED_BYTES = 1024


def _io_aligned(numel: int, elem_bytes: int) -> int:
    """``_io_aligned_numel``: ``numel`` rounded up to a whole number of 1 KiB blocks of ``elem_bytes`` elements."""
    step = _AIO_ALIGNED_BYTES // elem_bytes
    return math.ceil(numel / step) * step


def zero3_sub_groups(param_groups: Sequence[Sequence[int]], w: int, size: int) -> list[list[list[int]]]:
    """Per param group, its ZeRO-3 sub-groups as lists of full parameter numels (``_create_fp16_sub_groups``): a
    group whose partition fits ``sub_group_size`` is one sub-group, else parameters are taken until their partitions
    reach it."""
    out: list[list[list[int]]] = []
    for group in param_groups:
        if not group:
            continue
        if size >= sum(math.ceil(k / w) for k in group):
            out.append([list(group)])
            continue
        subs: list[list[int]] = []
        current: list[int] = []
        for i, k in enumerate(group):
            current.append(k)
            if sum(math.ceil(x / w) for x in current) >= size or i == len(group) - 1:
                subs.append(current)
                current = []
        out.append(subs)
    return out


def _part(sub: Sequence[int], w: int) -> int:
    return sum(math.ceil(k / w) for k in sub)


def nvme_param_terms(subs: list[list[list[int]]], w: int, h: int, layout: StrategyLayout) -> list[Term]:
    """Where ZeRO-Infinity keeps the weight partitions, and the pinned host buffers of parameter swapping."""
    bits = 8 * h
    cap = layout.max_in_cpu
    in_cpu, on_nvme, flat, seen = 0, 0, 0, 0
    left: list[list[int]] = []
    for group in subs:
        total = sum(_part(s, w) for s in group)
        size = total if seen + total <= cap else max(0, cap - seen)
        seen += total
        room = size or 1  # an empty group buffer is still torch.empty(1)
        flat += room
        offset = 0
        for sub in group:
            p = _part(sub, w)
            if offset + p <= room:
                in_cpu += p
            else:
                on_nvme += p
                left.append(sub)
            offset += p
    count, size = layout.params_buffer_count, layout.params_buffer_size
    aligned = _io_aligned(size, h)
    terms = [
        Term(
            "params",
            "cpu",
            f"{bits}-bit weight partitions, CPU flat buffers (max_in_cpu)",
            h * flat,
            f"{h} B x {_gb(flat)} (partitions up to max_in_cpu {cap:,}, a group at a time)",
        ),
        Term(
            "params", "nvme", f"{bits}-bit weight partitions beyond max_in_cpu", h * on_nvme, f"{h} B x {_gb(on_nvme)}"
        ),
        Term(
            "other",
            "cpu",
            "parameter swap buffers (pinned)",
            h * count * aligned,
            f"buffer_count {count} x {h} B x buffer_size {size:,} (1 KiB-aligned)",
        ),
    ]
    if left:
        # The first sub-group with the most partition elements; DeepSpeed sizes the buffer by its parameters' full
        # numels (ds_numel), not their partitions.
        biggest = max((s for g in subs for s in g), key=lambda s: _part(s, w))
        numel = sum(_io_aligned(k, h) for k in biggest)
        terms.append(
            Term(
                "other",
                "cpu",
                "parameter swap-out reuse buffer (pinned)",
                h * numel,
                f"{h} B x {_gb(numel)} (full params of the largest sub-group: some sub-group is on NVMe)",
            )
        )
    return terms


def nvme_optimizer_terms(
    subs: list[list[list[int]]], w: int, layout: StrategyLayout, optimizer: OptimizerStateModel
) -> list[Term]:
    """Optimizer offload to NVMe: swapped sub-groups on disk behind pinned fp32 buffers; small ones on the CPU."""
    flat = [sub for group in subs for sub in group]
    parts = [_part(sub, w) for sub in flat]
    swapped = [p for p in parts if 4 * p >= _MIN_AIO_BYTES]
    kept = [p for p in parts if 4 * p < _MIN_AIO_BYTES]
    s, k = sum(swapped), sum(kept)
    count = layout.optimizer_buffer_count
    largest = _io_aligned(max(parts, default=0), 4)
    # Gradient partitions under 1 MiB of a swapped sub-group are not written out: their fp32 copies stay where they
    # were made (on the device: partition_grads moves each partition there) until the step; so does the whole copy
    # of one whose length is not a multiple of 256 (its unaligned tail is a view of it).
    unswapped = sum(
        math.ceil(x / w)
        for sub, p in zip(flat, parts)
        if 4 * p >= _MIN_AIO_BYTES
        for x in sub
        if 4 * math.ceil(x / w) < _MIN_AIO_BYTES or math.ceil(x / w) % (_AIO_ALIGNED_BYTES // 4)
    )
    return [
        Term("grads", "nvme", "fp32 gradient partition (swapped sub-groups)", 4 * s, f"4 B x {_gb(s)}"),
        Term("optimizer_states", "nvme", "fp32 master partition (swapped sub-groups)", 4 * s, f"4 B x {_gb(s)}"),
        Term(
            "optimizer_states",
            "nvme",
            f"{optimizer.name} (swapped sub-groups)",
            optimizer.bytes_for(swapped, 4),
            optimizer.formula(4),
        ),
        Term(
            "other",
            "cpu",
            "optimizer swap buffers (pinned)",
            4 * count * largest,
            f"buffer_count {count} x 4 B x {_gb(largest)} (largest sub-group partition, 1 KiB-aligned)",
        ),
        Term(
            "optimizer_states",
            "cpu",
            f"{optimizer.name} before its first swap-out (first step)",
            optimizer.bytes_for([max(swapped, default=0)], 4),
            f"{optimizer.formula(4)} of the largest swapped sub-group",
            phase="in_step",
        ),
        Term(
            "grads",
            "device",
            "fp32 gradients too small or unaligned to swap",
            4 * unswapped,
            f"4 B x {_gb(unswapped)} (partitions < 1 MiB or not a multiple of 256)",
            phase="step",
        ),
        # Sub-groups under 1 MiB of fp32 are never swapped: CPU offload for them (fp32 gradient buffer included).
        Term("grads", "cpu", "fp32 gradient buffer (sub-groups < 1 MiB)", 4 * k, f"4 B x {_gb(k)}"),
        Term("optimizer_states", "cpu", "fp32 master partition (sub-groups < 1 MiB)", 4 * k, f"4 B x {_gb(k)}"),
        Term(
            "optimizer_states",
            "cpu",
            f"{optimizer.name} (sub-groups < 1 MiB)",
            optimizer.bytes_for(kept, 4),
            optimizer.formula(4),
        ),
    ]
