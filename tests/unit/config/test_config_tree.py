"""The config tree's presets: published model shapes, the defaults list, partials.

That every option of every group composes and binds to its targets is checked in ``test_config_keys.py``, by the
check ``train.py`` runs (``config.keys``).
"""

from __future__ import annotations

import pytest

from tests.helpers.compose import compose_config


def test_llama_presets_have_published_shapes(tmp_path):
    from hydra.utils import instantiate

    seven = instantiate(compose_config(["model=llama_7b"], tmp_path).model)
    assert (seven.n_layers, seven.d_model, seven.n_heads, seven.ffn_hidden, seven.vocab_size) == (
        32,
        4096,
        32,
        11008,
        32000,
    )
    assert seven.n_params() == pytest.approx(6.74e9, rel=0.002)
    thirteen = instantiate(compose_config(["model=llama_13b"], tmp_path).model)
    assert (thirteen.n_layers, thirteen.d_model, thirteen.n_heads, thirteen.ffn_hidden) == (40, 5120, 40, 13824)
    assert thirteen.n_params() == pytest.approx(13.0e9, rel=0.005)


def test_strategy_is_not_in_defaults(tmp_path):
    assert "strategy" not in compose_config([], tmp_path)


def test_optimizer_and_scheduler_are_partials(tmp_path):
    cfg = compose_config([], tmp_path)
    assert cfg.optimizer._partial_ is True
    assert cfg.scheduler._partial_ is True
    assert cfg.scheduler._target_.endswith("warmup_cosine")
