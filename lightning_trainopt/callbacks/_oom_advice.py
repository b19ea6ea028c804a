"""Advice with numbers for an out-of-memory error, from the memory categories at the peak (pure functions)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["oom_advice"]

_GIB = 2**30


def oom_advice(
    breakdown: Mapping[str, int | None],
    device_bytes: int | None = None,
    n_layers: int | None = None,
    micro_batch: int | None = None,
    accumulate: int = 1,
    world_size: int = 1,
) -> list[str]:
    """Concrete remedies, largest saving first.

    Args:
        breakdown: bytes at the peak: ``params``, ``grads``, ``optimizer_states``, ``activations``, ``other``, ``peak``,
            and optionally ``activations_weight_copies`` (the part of ``activations`` that autocast's weight copies
            take, which a smaller micro-batch does not cut).
        device_bytes: device memory, to say how far over the peak went.
        n_layers: transformer blocks (for the checkpointing estimate).
        micro_batch: current micro-batch per device.
        accumulate: current ``accumulate_grad_batches``.
        world_size: data-parallel replicas (``ParallelDims.dp``, for the ZeRO estimate).
    """
    b = {k: int(v or 0) for k, v in breakdown.items()}
    peak = b.get("peak") or sum(b.get(k, 0) for k in ("params", "grads", "optimizer_states", "activations", "other"))
    if peak <= 0:
        return ["no memory figures were recorded before the error; run with MemoryBreakdown(at_steps=[0])"]
    acts, opt = b.get("activations", 0), b.get("optimizer_states", 0)
    advice: list[tuple[float, str]] = []
    if acts:
        share = 100 * acts / peak
        blocks = f" ({n_layers // 2} of {n_layers} blocks)" if n_layers else ""
        advice.append(
            (
                acts / 2,
                f"activations are {share:.0f}% of the peak ({acts / _GIB:.2f} GiB); checkpointing every "
                f"second block{blocks} saves about {acts / 2 / _GIB:.2f} GiB",
            )
        )
        per_batch = max(0, acts - b.get("activations_weight_copies", 0))
        if micro_batch and micro_batch > 1 and per_batch:
            advice.append(
                (
                    per_batch / 2,
                    f"halve the micro-batch ({micro_batch} -> {micro_batch // 2}) and double "
                    f"accumulation ({accumulate} -> {2 * accumulate}): about {per_batch / 2 / _GIB:.2f} GiB less, "
                    f"same tokens per optimizer step",
                )
            )
    if opt and world_size > 1:
        saved = opt * (1 - 1 / world_size)
        advice.append(
            (
                saved,
                f"optimizer states are {opt / _GIB:.2f} GiB; sharding them over {world_size} ranks "
                f"(ZeRO-1/FSDP) saves about {saved / _GIB:.2f} GiB per rank",
            )
        )
    elif opt:
        advice.append(
            (
                opt,
                f"optimizer states are {opt / _GIB:.2f} GiB; an 8-bit optimizer saves about "
                f"{0.75 * opt / _GIB:.2f} GiB, CPU offload saves all of it",
            )
        )
    advice.sort(key=lambda item: -item[0])
    lines = [text for _, text in advice]
    if device_bytes:
        lines.insert(0, f"the step needed at least {peak / _GIB:.2f} GiB of {device_bytes / _GIB:.2f} GiB")
    return lines
