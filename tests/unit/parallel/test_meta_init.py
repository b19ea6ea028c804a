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


def test_two_models_built_one_after_the_other_get_their_eager_values():
    # A distillation student and then its teacher: each GPT initialises itself when its own construction ends, so
    # the teacher's draws come after the student's init. Replaying all construction first gave the student others.
    teacher_shape = GPTConfig(name="t", vocab_size=67, n_layers=1, d_model=48, n_heads=2, ffn_hidden=64, max_seq_len=16)
    torch.manual_seed(SEED)
    eager = torch.nn.ModuleDict({"model": GPT(SHAPE), "teacher": GPT(teacher_shape)})
    torch.manual_seed(SEED)
    state = torch.get_rng_state()
    with torch.device("meta"):
        holder = torch.nn.ModuleDict({"model": GPT(SHAPE), "teacher": GPT(teacher_shape)})
    materialize_sharded(holder, torch.device("cpu"), state)
    for (name, p), q in zip(holder.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q), name
