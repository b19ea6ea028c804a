"""Choosing the micro-batch that fits a memory budget while keeping the global batch (pure arithmetic)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_trainopt.exceptions import ConfigError

__all__ = ["MicroBatchPlan", "divisors", "fit_linear_bytes", "plan_micro_batch"]


@dataclass(frozen=True)
class MicroBatchPlan:
    """A micro-batch and accumulation with ``micro_batch * accumulate * world_size == global_batch``.

    Args:
        micro_batch: samples per device per forward pass.
        accumulate: gradient accumulation steps.
        world_size: data-parallel processes.
        global_batch: samples per optimizer step (what the user asked for, unchanged).
        per_sample_bytes: measured activation bytes per sample.
        fixed_bytes: bytes that do not grow with the micro-batch (model states, activations' constant part).
        budget_bytes: the memory budget per device.
        predicted_bytes: ``fixed_bytes + micro_batch * per_sample_bytes``.
    """

    micro_batch: int
    accumulate: int
    world_size: int
    global_batch: int
    per_sample_bytes: int
    fixed_bytes: int
    budget_bytes: int
    predicted_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def fit_linear_bytes(bytes_at_1: int, bytes_at_2: int) -> tuple[int, int]:
    """``(per_sample, constant)`` from activation bytes measured at micro-batches 1 and 2."""
    per_sample = max(0, bytes_at_2 - bytes_at_1)
    return per_sample, max(0, bytes_at_1 - per_sample)


def plan_micro_batch(
    global_batch: int,
    world_size: int,
    per_sample_bytes: int,
    fixed_bytes: int,
    budget_bytes: int,
    max_micro_batch: int | None = None,
    key: str = "callbacks.micro_batch_finder.budget_bytes",
) -> MicroBatchPlan:
    """The largest micro-batch dividing ``global_batch / world_size`` whose predicted bytes fit the budget.

    Raises:
        ConfigError: the global batch is not divisible by the world size, or even a micro-batch of 1 does not fit.
    """
    if global_batch < 1 or world_size < 1 or global_batch % world_size:
        raise ConfigError(
            "data.batch_size",
            global_batch,
            f"the global batch ({global_batch}) must be a positive multiple of the world size ({world_size}).",
        )
    per_device = global_batch // world_size
    candidates = [d for d in divisors(per_device) if max_micro_batch is None or d <= max_micro_batch]
    fitting = [d for d in candidates if fixed_bytes + d * per_sample_bytes <= budget_bytes]
    if not fitting:
        need = fixed_bytes + per_sample_bytes
        raise ConfigError(
            key,
            budget_bytes,
            f"even a micro-batch of 1 needs about {need / 2**30:.3f} GiB ({fixed_bytes / 2**30:.3f} GiB fixed + "
            f"{per_sample_bytes / 2**30:.3f} GiB per sample); raise the budget, shard the model states (ZeRO / FSDP) "
            "or cut activations (activations=checkpoint).",
        )
    micro = max(fitting)
    return MicroBatchPlan(
        micro_batch=micro,
        accumulate=per_device // micro,
        world_size=world_size,
        global_batch=global_batch,
        per_sample_bytes=per_sample_bytes,
        fixed_bytes=fixed_bytes,
        budget_bytes=budget_bytes,
        predicted_bytes=fixed_bytes + micro * per_sample_bytes,
    )
