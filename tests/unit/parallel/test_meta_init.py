"""The meta build's replay on one process (the 2-rank checks are in ``test_meta_build.py``, one spawn for all)."""

from __future__ import annotations

import torch

from lightning_trainopt.models import GPT
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.parallel.meta_init import materialize_sharded

SHAPE = GPTConfig(name="meta", vocab_size=67, n_layers=2, d_model=32, n_heads=2, ffn_hidden=48, max_seq_len=16)
SEED = 1234


def test_an_unsharded_meta_model_gets_the_eager_values():
    torch.manual_seed(SEED)
    eager = GPT(SHAPE)
    torch.manual_seed(SEED)
    state = torch.get_rng_state()
    with torch.device("meta"):
        holder = torch.nn.ModuleDict({"model": GPT(SHAPE)})
    materialize_sharded(holder, torch.device("cpu"), state)
    for (name, p), q in zip(holder["model"].named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q), name
