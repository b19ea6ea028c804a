"""ZeRO-3's gathered working set, replayed from DeepSpeed's fetch / prefetch / reuse-distance rules."""

from __future__ import annotations

from lightning_trainopt.planner import gpt_module_trace, zero3_gathered_peak_numel

# Four modules of one parameter each, in forward order; the backward replays them reversed.
TRACE = (((0, 100),), ((1, 300),), ((2, 200),), ((3, 5),))


def test_without_prefetch_or_reuse_one_module_is_gathered_at_a_time():
    assert zero3_gathered_peak_numel(TRACE, 10, 0, 10**9, 0) == 300


def test_prefetch_adds_the_next_modules_until_the_bucket_is_crossed():
    # At module 0 (100 live) the prefetch takes module 1 (300 >= bucket 50): 400; at module 1: + module 2 = 500.
    assert zero3_gathered_peak_numel(TRACE, 10, 50, 10**9, 0) == 500


def test_prefetch_is_capped_by_max_live_parameters():
    # max_live 350: at module 1 (300 live) a budget of 50 still fetches module 2 (the one that crosses it): 500.
    assert zero3_gathered_peak_numel(TRACE, 10, 10**9, 350, 0) == 500
    # max_live 100: no budget left once a module is live, so nothing is prefetched: the largest module alone.
    assert zero3_gathered_peak_numel(TRACE, 10, 10**9, 100, 0) == 300


def test_a_large_reuse_distance_keeps_everything_gathered_through_the_turn():
    # DeepSpeed's default max_reuse_distance (1e9) exceeds this model: nothing is released before its backward use.
    assert zero3_gathered_peak_numel(TRACE, 10, 0, 10**9, 10**9) == 600  # the 5-element module is persistent


def test_reuse_distance_keeps_only_the_modules_reused_soon():
    # Trace 0 1 2 3 | 3 2 1 0: module 1 is used again 200 + 5 + 5 + 200 = 410 elements later (< 500): kept through
    # the turn; module 0 only after 1,010 elements: released after its forward. Peak {1, 2, 3}, not all 605.
    assert zero3_gathered_peak_numel(TRACE, 0, 0, 10**9, 500) == 300 + 200 + 5


def test_gpt_trace_lists_every_parameter_once_and_ties_the_embedding():
    tied = gpt_module_trace(256, 64, 32, 128, 2, True)
    untied = gpt_module_trace(256, 64, 32, 128, 2, False)
    assert len(tied) == 1 + 9 * 2 + 2
    assert tied[-1] == tied[0]  # lm_head uses the embedding's parameter
    total = {pid: n for mod in untied for pid, n in mod}
    assert sum(total.values()) == 2 * 256 * 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 64
