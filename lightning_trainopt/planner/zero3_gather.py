"""How many parameter elements ZeRO-3 holds gathered (whole) on a device at once, replayed from its own rules.

DeepSpeed 0.19 ``runtime/zero/partitioned_param_coordinator.py``, with the trace of module executions (forward, then
backward in reverse) that the coordinator records on the first step:

- ``fetch_sub_module`` gathers the module's own parameters, then prefetches the parameters of the next modules in
  the trace while fewer than ``min(max_live_parameters - available, prefetch_bucket_size)`` elements are in flight
  (the module that crosses the limit is still fetched);
- ``release_sub_module`` -> ``__params_to_release`` keeps a parameter gathered when it is used again within the next
  ``max_reuse_distance`` elements of the trace: with DeepSpeed's default of 1e9 (Lightning passes none), the last
  blocks stay gathered from their forward through their backward;
- parameters of at most ``param_persistence_threshold`` elements (DeepSpeed: ``ds_numel <= threshold``) are always
  gathered (``ds_persist``) and counted apart.

The result is the peak of the gathered working set, in elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

__all__ = ["gpt_module_trace", "zero3_gathered_peak_numel"]


def gpt_module_trace(
    vocab_size: int, d_model: int, kv_dim: int, ffn_hidden: int, n_layers: int, tie_embeddings: bool
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The forward order of :class:`~lightning_trainopt.models.GPT`'s parameter-owning modules.

    Returns:
        one entry per module execution: ``((param_id, numel), ...)`` of its own parameters (a tied embedding is the
        same parameter in ``embed`` and ``lm_head``).
    """
    d = d_model
    trace: list[tuple[tuple[int, int], ...]] = [((0, vocab_size * d),)]
    pid = 1
    for _ in range(n_layers):
        for numel in (d, d * d, d * kv_dim, d * kv_dim, d * d, d, d * ffn_hidden, d * ffn_hidden, ffn_hidden * d):
            trace.append(((pid, numel),))
            pid += 1
    trace.append(((pid, d),))
    trace.append(((0, vocab_size * d),) if tie_embeddings else ((pid + 1, vocab_size * d),))
    return tuple(trace)


@lru_cache(maxsize=64)
def zero3_gathered_peak_numel(
    trace: tuple[tuple[tuple[int, int], ...], ...],
    persistence_threshold: int,
    prefetch_bucket_size: int,
    max_live_parameters: int,
    max_reuse_distance: int,
) -> int:
    """Peak elements of non-persistent parameters gathered at once over one forward and backward.

    Args:
        trace: the forward order of module executions (see :func:`gpt_module_trace`); backward replays it reversed.
        persistence_threshold: ``stage3_param_persistence_threshold``; parameters of at most this many elements are
            not counted here.
        prefetch_bucket_size: ``stage3_prefetch_bucket_size`` (DeepSpeed default 5e7 elements).
        max_live_parameters: ``stage3_max_live_parameters`` (default 1e9).
        max_reuse_distance: ``stage3_max_reuse_distance`` (default 1e9).
    """
    order: Sequence[tuple[tuple[int, int], ...]] = trace + tuple(reversed(trace))
    size = {pid: n for mod in order for pid, n in mod}
    persistent = {pid for pid, n in size.items() if n <= persistence_threshold}
    available: set[int] = set()
    peak = 0
    for step, mod in enumerate(order):
        available.update(pid for pid, _ in mod if pid not in persistent)
        live = sum(size[p] for p in available)
        budget = min(max_live_parameters - live, prefetch_bucket_size)
        prefetched, queued = 0, set()
        for later in order[step + 1 :]:
            if prefetched >= budget:
                break
            for pid, n in later:
                if pid not in persistent and pid not in available and pid not in queued:
                    queued.add(pid)
                    prefetched += n
        peak = max(peak, live + prefetched)
        for pid, _ in mod:
            if pid in persistent:
                continue
            traversed = 0
            reused = False
            for later in order[step + 1 :]:
                if traversed >= max_reuse_distance:
                    break
                if any(p == pid for p, _ in later):
                    reused = True
                    break
                traversed += sum(n for _, n in later)
            if not reused:
                available.discard(pid)
    return peak
