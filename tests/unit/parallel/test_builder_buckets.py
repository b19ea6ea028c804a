"""DeepSpeed buckets of the ZeRO-1/2 presets are sized to the model, and the planner plans the buckets that run."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.config.plan import plan
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.planner.model_states import MODEL_SIZED_BUCKET_CAP
from lightning_trainopt.precision import PrecisionSpec
from tests.helpers.compose import REPO_ROOT, compose_config

pytest.importorskip("deepspeed")

from lightning_trainopt.config.strategy import build_strategy  # noqa: E402

BF16 = PrecisionSpec(name="bf16", trainer_precision="bf16-mixed")
TRAINER = {"accumulate_grad_batches": 1, "gradient_clip_val": 1.0}
TINY_PARAMS = 836_736  # gpt_tiny


def _preset(name: str, **overrides):
    node = OmegaConf.load(REPO_ROOT / "lightning_trainopt" / "conf" / "strategy" / f"{name}.yaml")
    for key, value in overrides.items():
        node[key] = value
    return node


def _buckets(strategy) -> tuple[int, int]:
    zero = strategy.config["zero_optimization"]
    return zero["reduce_bucket_size"], zero["allgather_bucket_size"]


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_offload"])
def test_auto_buckets_hold_the_model_and_no_more(name):
    assert _preset(name).reduce_bucket_size == "auto"
    built = build_strategy(_preset(name), BF16, TRAINER, micro_batch_size=2, n_params=TINY_PARAMS)
    assert _buckets(built) == (TINY_PARAMS, TINY_PARAMS)


def test_auto_buckets_of_a_large_model_stop_at_the_cap():
    built = build_strategy(_preset("zero2"), BF16, TRAINER, n_params=6_738_415_616)
    assert _buckets(built) == (MODEL_SIZED_BUCKET_CAP, MODEL_SIZED_BUCKET_CAP)


def test_an_explicit_bucket_size_wins_over_auto():
    node = _preset("zero2", reduce_bucket_size=123_456, allgather_bucket_size=2e6)
    assert _buckets(build_strategy(node, BF16, TRAINER, n_params=TINY_PARAMS)) == (123_456, 2_000_000)


@pytest.mark.parametrize("value", ["big", 0, 1.5, True])
def test_a_bad_bucket_size_names_the_key_and_the_fix(value):
    with pytest.raises(ConfigError, match=r"strategy\.reduce_bucket_size.*auto"):
        build_strategy(_preset("zero2", reduce_bucket_size=value), BF16, TRAINER, n_params=TINY_PARAMS)


def _planned_bucket_bytes(overrides: list[str], tmp_path) -> int:
    cfg = compose_config(["model=gpt_tiny", "trainer=ddp_sim", "precision=bf16", *overrides], tmp_path, name="plan")
    terms = [t for t in plan(cfg).estimate.memory.terms if t.label.startswith("reduce bucket")]
    assert len(terms) == 1, terms
    return terms[0].nbytes


@pytest.mark.parametrize(
    ("overrides", "elements"),
    [
        (["+strategy=zero2"], TINY_PARAMS),
        (["+strategy=zero1"], TINY_PARAMS),
        (["+strategy=zero2", "strategy.reduce_bucket_size=123456"], 123_456),
    ],
)
def test_the_planner_plans_the_buckets_the_builder_runs(overrides, elements, tmp_path):
    cfg = compose_config(["model=gpt_tiny", "trainer=ddp_sim", "precision=bf16", *overrides], tmp_path)
    n_params = GPTConfig(**{k: v for k, v in cfg.model.items() if k != "_target_"}).n_params()
    assert n_params == TINY_PARAMS
    built = build_strategy(cfg.strategy, BF16, cfg.trainer, micro_batch_size=cfg.data.batch_size, n_params=n_params)
    assert _buckets(built)[0] == elements
    # Two bf16 buffers (overlap_comm, Lightning's default) of the bucket that runs.
    assert _planned_bucket_bytes(overrides, tmp_path) == 2 * 2 * elements
