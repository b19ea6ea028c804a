"""The private transformers attributes ``_compat/transformers_internals.py`` reads are still there on real models."""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt._compat import transformers_internals as ti
from tests.unit.compat._upstream import require, require_in_range

transformers = pytest.importorskip("transformers")
RANGE = ti.TRANSFORMERS_RANGE


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def test_installed_transformers_is_in_the_range_written_for():
    require_in_range("transformers", RANGE, "transformers_internals")


def _require(condition: bool, what: str) -> None:
    require(condition, "transformers", what, RANGE, "transformers_internals")


def test_no_split_modules_names_the_block(gpt2):
    _require(ti.no_split_modules(gpt2) == ["GPT2Block"], "_no_split_modules")
    assert ti.no_split_modules(torch.nn.Linear(2, 2)) == []


def test_per_module_init_is_told_apart(gpt2):
    _require(ti.has_per_module_init(gpt2), "PreTrainedModel._initialize_weights")
    assert not ti.has_per_module_init(torch.nn.Linear(2, 2))


def test_a_marked_parameter_is_skipped_by_hf_init_unless_the_mark_is_lifted():
    # The mark is what transformers' init functions test before writing; ZeRO-3's re-init lifts it to write again.
    from transformers import initialization

    p = torch.nn.Parameter(torch.zeros(4))
    p._is_hf_initialized = True
    initialization.normal_(p)
    _require(bool((p == 0).all()), "the _is_hf_initialized mark that transformers.initialization skips")
    with ti.init_marks_lifted([p]):
        assert "_is_hf_initialized" not in p.__dict__
        initialization.normal_(p)
    assert not bool((p == 0).all())
    assert p._is_hf_initialized is True


def test_build_order_follows_post_init_of_the_nested_model_before_the_head():
    # transformers 5: LlamaModel's own post_init initialises it inside LlamaForCausalLM.__init__, before the head is
    # constructed; the meta build's replay (tests/unit/parallel/test_meta_build.py) relies on this order.
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    steps = [(module, init is not None) for module, init in ti.build_order(model)]
    inner_init = steps.index((model.model, True))
    head_built = steps.index((model.lm_head, False))
    _require(inner_init < head_built, "PreTrainedModel.post_init initialising a nested model in its __init__")
    assert steps.index((model.model.embed_tokens, False)) < steps.index((model.model.embed_tokens, True)) < inner_init
    assert steps[-1] == (model, True)
    assert ti.build_order(torch.nn.Linear(2, 2)) == []
