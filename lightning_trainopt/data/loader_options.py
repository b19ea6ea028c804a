"""The DataLoader knobs the data modules share (``data.num_workers``, ``data.pin_memory``, ...): checks, kwargs."""

from __future__ import annotations

from typing import Any

import torch

from lightning_trainopt.exceptions import ConfigError

__all__ = ["check_loader_options", "loader_kwargs"]


def check_loader_options(
    num_workers: Any, pin_memory: Any, prefetch_factor: Any, persistent_workers: Any, prefix: str = "data"
) -> None:
    """Raise unless the knobs are valid together (prefetching and persistent workers need worker processes).

    Raises:
        ConfigError: the first invalid knob, with its key under ``prefix``.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"{prefix}.num_workers", num_workers, "use an integer >= 0.")
    for key, flag in (("pin_memory", pin_memory), ("persistent_workers", persistent_workers)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{prefix}.{key}", flag, f"use true or false (got a {type(flag).__name__}).")
    if prefetch_factor is not None and (
        isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1
    ):
        raise ConfigError(
            f"{prefix}.prefetch_factor", prefetch_factor, "use a positive number of batches per worker, or null."
        )
    if prefetch_factor is not None and num_workers == 0:
        raise ConfigError(
            f"{prefix}.prefetch_factor",
            prefetch_factor,
            f"prefetching needs worker processes; set {prefix}.num_workers>0.",
        )
    if persistent_workers and num_workers == 0:
        raise ConfigError(
            f"{prefix}.persistent_workers", persistent_workers, f"needs worker processes; set {prefix}.num_workers>0."
        )


def loader_kwargs(
    num_workers: int, pin_memory: bool, prefetch_factor: int | None, persistent_workers: bool
) -> dict[str, Any]:
    """``DataLoader`` keyword arguments for the knobs; ``pin_memory`` only takes effect on CUDA."""
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory and torch.cuda.is_available()}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    return kwargs
