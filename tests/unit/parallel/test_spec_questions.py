"""One StrategySpec: callers ask it questions, the planner reads its layout, the node is read in config/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.config.strategy import strategy_spec
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.spec import StrategySpec, parse_strategy, spec_of
from lightning_trainopt.planner.strategy_layout import StrategyLayout, StrategyQuestions
from tests.helpers.compose import REPO_ROOT
from tests.unit.parallel.test_spec import PRESETS, _preset

QUESTIONS = (
    "shards_optimizer",
    "shards_grads",
    "shards_params",
    "gathers_for_forward",
    "reduces_at_boundary",
    "offloads_optimizer",
    "offloads_params",
    "offloads_to_nvme",
    "flat_partitions",
    "shards_each_param",
    "ddp_buckets",
    "wraps_in_engine",
    "steps_cpu_adam",
    "own_precision_plugin",
)
# What each preset does, written out by hand from docs/strategies.md (columns in the order of QUESTIONS).
ANSWERS = {
    "ddp": "- - - - - - - - - - D - - -",
    "deepspeed_json": "O G - - - o - - F - - E C P",  # ZeRO-2 with CPU optimizer offload (the JSON of _preset)
    "fsdp": "O G S S - - - - - E - - - P",
    "fsdp_offload": "O G S S - o p - - E - - - P",
    "zero1": "O - - - B - - - F - - E - P",
    "zero2": "O G - - - - - - F - - E - P",
    "zero2_offload": "O G - - - o - - F - - E C P",
    "zero3": "O G S S - - - - F - - E - P",
    "zero3_offload": "O G S S - o p - F - - E C P",
    "zero_infinity": "O G S S - o p n F - - E C P",
}


def _answers(spec: StrategyQuestions) -> list[bool]:
    return [bool(getattr(spec, q)) for q in QUESTIONS]


def test_the_answer_table_covers_every_preset():
    assert sorted(ANSWERS) == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_answers_what_it_does(name, tmp_path):
    spec = parse_strategy(_preset(name, tmp_path))
    assert _answers(spec) == [cell != "-" for cell in ANSWERS[name].split()]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("world_size", [1, 4])
def test_the_planners_layout_answers_as_its_spec_does(name, world_size, tmp_path):
    spec = parse_strategy(_preset(name, tmp_path))
    layout = spec.layout(world_size)
    assert isinstance(layout, StrategyLayout)
    assert (layout.name, layout.offload_optimizer, layout.offload_params) == (
        name,
        spec.offload_optimizer,
        spec.offload_params,
    )
    assert _answers(layout) == _answers(spec)
    assert layout.has_strategy


def test_without_a_strategy_the_layout_is_lightnings_choice_and_nothing_is_sharded():
    spec = parse_strategy(None)
    assert not spec.chosen
    assert not any(_answers(spec))
    assert spec.layout(1) == StrategyLayout(name="single", kind="single")
    assert not spec.layout(1).has_strategy
    assert spec.layout(2) == StrategyLayout(name="ddp", kind="ddp")


def test_the_planner_refuses_what_it_does_not_model_naming_the_key():
    stage0 = parse_strategy({"_target_": "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy", "stage": 0})
    with pytest.raises(ConfigError) as err:
        stage0.layout(2)
    assert err.value.key == "strategy.stage"
    other = parse_strategy({"_target_": "lightning.pytorch.strategies.SingleDeviceStrategy", "device": "cpu"})
    with pytest.raises(ConfigError) as err:
        other.layout(1)
    assert err.value.key == "strategy._target_"


def test_the_node_is_read_from_a_dictconfig_in_config_and_only_plain_values_below(tmp_path):
    node = OmegaConf.create({"_target_": "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy", "stage": "${s}"})
    cfg = OmegaConf.create({"s": 3, "strategy": node})
    assert strategy_spec(cfg.strategy) == parse_strategy({"_target_": node._target_, "stage": 3})
    with pytest.raises(ConfigError) as err:
        parse_strategy(["zero3"])  # type: ignore[arg-type]
    assert err.value.key == "strategy"


def test_a_built_strategy_answers_as_its_node():
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.precision import PrecisionSpec

    bf16 = PrecisionSpec(name="bf16", trainer_precision="bf16-mixed")
    built = build_strategy(_preset("zero3_offload"), bf16, {"devices": 1}, micro_batch_size=2)
    assert _answers(spec_of(built)) == _answers(parse_strategy(_preset("zero3_offload")))
    # A DeepSpeedStrategy built by hand, without our spec, is read from its config.
    own = DeepSpeedStrategy(stage=1)
    assert spec_of(own).reduces_at_boundary
    assert not spec_of(own).shards_grads


# Tests of a strategy's kind or ZeRO stage, which code outside parallel/ must not make (it asks the spec instead).
_KIND_TEST = re.compile(
    r"\.kind\s*(==|!=|in\b)|isinstance\([^)]*(DeepSpeed|FSDP|DDP)Strategy|zero_stage\s*(==|!=|>|<|in\b)"
    r"|stage\s*[<>]=?\s*\d|__name__\.startswith\(\"DeepSpeed"
)
# Modules below parallel/ that still test the class of the built Lightning strategy: they pick Lightning's own
# precision plugin or a build context, and the layers let them import neither parallel/ nor the spec.
_BELOW_PARALLEL = {
    "lightning_trainopt/precision/plugins.py",
    "lightning_trainopt/models/optimization.py",
    "lightning_trainopt/models/lit_lm.py",
}
# Loss kinds and inspect.Parameter kinds share the word; they are no strategy.
_NOT_A_STRATEGY = re.compile(r"\bp\.kind|loss\.kind|self\.kind not in LOSS_KINDS|_probe\.kind|_verdict\.kind|v\.kind")


def test_nothing_outside_parallel_branches_on_a_strategys_kind():
    package = REPO_ROOT / "lightning_trainopt"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if rel.startswith("lightning_trainopt/parallel/") or rel in _BELOW_PARALLEL:
            continue
        if rel == "lightning_trainopt/planner/strategy_layout.py":
            continue  # where the questions are defined
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if _KIND_TEST.search(line) and not _NOT_A_STRATEGY.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_only_the_spec_makes_a_layout_outside_tests():
    package = REPO_ROOT / "lightning_trainopt"
    makers = {
        path.relative_to(REPO_ROOT).as_posix()
        for path in package.rglob("*.py")
        if re.search(r"\bStrategyLayout\(", path.read_text()) and path.name != "strategy_layout.py"  # defines it
    }
    assert makers == {"lightning_trainopt/parallel/spec.py"}


def test_the_spec_and_the_layout_share_one_definition_of_each_question():
    for question in QUESTIONS:
        assert getattr(StrategySpec, question) is getattr(StrategyQuestions, question)
        assert getattr(StrategyLayout, question) is getattr(StrategyQuestions, question)


def test_the_layout_plans_what_fsdp_reshards_after_forward(tmp_path):
    assert parse_strategy(_preset("fsdp")).layout(2).reshard_after_forward is True
    kept = parse_strategy({**_preset("fsdp"), "reshard_after_forward": False}).layout(2)
    assert kept.reshard_after_forward is False
    fsdp1 = parse_strategy({"_target_": "lightning.pytorch.strategies.FSDPStrategy", "name": "fsdp1"})
    assert fsdp1.layout(2).reshard_after_forward is True
