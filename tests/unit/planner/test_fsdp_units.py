"""FSDP2's gathered units in the per-device peak: the units apply_fully_shard makes, and what backward holds."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import OPTIMIZER_STATES, StrategyLayout, estimate_model_states, gpt_param_groups
from lightning_trainopt.planner.fsdp_units import FSDPUnits, gpt_fsdp_units

# bench/planner_fsdp.py's model: 4 blocks of 803,328 elements, a 131,328-element root unit.
CFG = GPTConfig(
    name="probe", vocab_size=256, n_layers=4, d_model=256, n_heads=4, ffn_hidden=704, max_seq_len=256,
    tie_embeddings=False,
)  # fmt: skip


def _units(cfg: GPTConfig) -> FSDPUnits:
    return gpt_fsdp_units(cfg.vocab_size, cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden, cfg.n_layers,
                          cfg.tie_embeddings)  # fmt: skip


@pytest.mark.parametrize("tie", [False, True])
def test_units_are_the_blocks_and_the_rest_of_the_real_model(tie):
    from lightning_trainopt.models import GPT

    cfg = GPTConfig(name="g", vocab_size=300, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=172,
                    max_seq_len=64, tie_embeddings=tie)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg)
    units = _units(cfg)
    assert units.blocks == tuple(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    assert units.root == sum(p.numel() for p in model.parameters()) - sum(units.blocks)
    assert units.head == model.lm_head.weight.numel()


def test_backward_holds_the_root_the_heads_gradient_and_four_block_units():
    est = estimate_model_states(
        gpt_param_groups(CFG), "32-true", StrategyLayout(kind="fsdp"), OPTIMIZER_STATES["adamw"], 2,
        fsdp_units=_units(CFG),
    )  # fmt: skip
    gathered = sum(t.nbytes for t in est.terms if t.label.startswith("FSDP2") and t.phase == "backward")
    block, root, head = 803_328, 131_328, 65_536
    # Block i's parameters and gradients, block i-1's prefetched all-gather output, block i+1's reduce-scatter input.
    assert gathered == 4 * (root + head + 4 * block)
    resident = sum(t.nbytes for t in est.terms if t.location == "device" and t.phase == "all")
    assert est.peak() >= resident + gathered


def test_fewer_blocks_hold_fewer_units_and_no_reshard_keeps_every_block():
    def held(blocks: int, reshard: bool = True) -> int:
        terms = FSDPUnits(blocks=(10,) * blocks, root=3, head=1).gathered_terms(1, 1, reshard)
        return sum(t.nbytes for t in terms)

    assert [held(k) for k in (1, 2, 3, 6)] == [4 + 20, 4 + 30, 4 + 40, 4 + 40]
    # reshard_after_forward=False: every block stays gathered; the computing block's gradient and the kept input.
    assert held(6, reshard=False) == 4 + 60 + 20
