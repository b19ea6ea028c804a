"""Choosing the micro-batch that fits a memory budget while keeping the global batch (pure arithmetic)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_trainopt.exceptions import ConfigError

__all__ = ["MicroBatchPlan", "divisors", "fit_linear_bytes", "nearby_global_batches", "plan_micro_batch"]


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
        largest_fitting: the largest micro-batch the budget allows, divisor of the per-device batch or not (capped by
            the per-device batch and ``max_micro_batch``); far above ``micro_batch`` when the batch divides badly.
    """

    micro_batch: int
    accumulate: int
    world_size: int
    global_batch: int
    per_sample_bytes: int
    fixed_bytes: int
    budget_bytes: int
    predicted_bytes: int
    largest_fitting: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def divisor_advice(self) -> str | None:
        """A warning when the chosen micro-batch is under half of :attr:`largest_fitting`, else ``None``.

        Only divisors of the per-device batch keep the global batch exactly, so a global batch with few divisors
        (a prime one falls back to 1) wastes most of the budget; the message names the nearest global batches
        (multiples of the world size) whose per-device batch has a divisor at least half the largest that fits.
        """
        if self.largest_fitting < 2 or 2 * self.micro_batch >= self.largest_fitting:
            return None
        better = nearby_global_batches(self.global_batch, self.world_size, self.largest_fitting)
        hint = f"; global batches near it that divide well: {better}" if better else ""
        return (
            f"the budget fits micro-batches up to {self.largest_fitting}, but the per-device batch "
            f"{self.global_batch // self.world_size} (global {self.global_batch}) has no divisor above "
            f"{self.micro_batch} that fits, so each step runs {self.accumulate} micro-batches of {self.micro_batch}"
            f"{hint} (global batch = data.batch_size x trainer.accumulate_grad_batches x world size)."
        )


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _best_divisor(n: int, limit: int) -> int:
    return max(d for d in divisors(n) if d <= limit)


def nearby_global_batches(global_batch: int, world_size: int, largest: int, count: int = 2) -> list[int]:
    """Up to ``count`` global batches nearest ``global_batch`` whose per-device batch has a divisor of at least
    ``largest / 2`` (and at most ``largest``), nearest first, never more than a quarter away."""
    want = -(-largest // 2)
    found: list[int] = []
    reach = max(world_size, global_batch // 4)
    for delta in range(world_size, reach + 1, world_size):
        for g in (global_batch - delta, global_batch + delta):
            if g >= world_size and _best_divisor(g // world_size, largest) >= want and g not in found:
                found.append(g)
        if len(found) >= count:
            break
    return found[:count]


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
    cap = min(per_device, max_micro_batch or per_device)
    if per_sample_bytes > 0:
        cap = min(cap, (budget_bytes - fixed_bytes) // per_sample_bytes)
    return MicroBatchPlan(
        micro_batch=micro,
        accumulate=per_device // micro,
        world_size=world_size,
        global_batch=global_batch,
        per_sample_bytes=per_sample_bytes,
        fixed_bytes=fixed_bytes,
        budget_bytes=budget_bytes,
        predicted_bytes=fixed_bytes + micro * per_sample_bytes,
        largest_fitting=int(cap),
    )
