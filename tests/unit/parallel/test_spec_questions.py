"""One StrategySpec: callers ask it questions, the planner reads its layout, the node is read in config/."""

from __future__ import annotations

import ast
import re

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
    "builds_partitioned",
)
# What each preset does, written out by hand from docs/strategies.md (columns in the order of QUESTIONS).
ANSWERS = {
    "ddp": "- - - - - - - - - - D - - - -",
    "deepspeed_json": "O G - - - o - - F - - E C P -",  # ZeRO-2 with CPU optimizer offload (the JSON of _preset)
    "fsdp": "O G S S - - - - - E - - - P -",
    "fsdp_offload": "O G S S - o p - - E - - - P -",
    # Tensor parallelism splits each weight (and its gradient and optimizer state) over the TP ranks, as FSDP2 does
    # over the others: each rank keeps its slice of every parameter (DTensor).
    "fsdp_tp": "O G S S - - - - - E - - - P -",
    "tp": "O G S S - - - - - E - - - P -",
    "zero1": "O - - - B - - - F - - E - P -",
    "zero2": "O G - - - - - - F - - E - P -",
    "zero2_offload": "O G - - - o - - F - - E C P -",
    "zero3": "O G S S - - - - F - - E - P Z",
    "zero3_offload": "O G S S - o p - F - - E C P Z",
    "zero_infinity": "O G S S - o p n F - - E C P Z",
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


# What code outside parallel/ must not do to learn what a strategy is (it asks the spec, or takes an answer that
# parallel/ worked out): test a strategy's class, its kind, its ZeRO stage or its name.
_STRATEGY_CLASSES = frozenset(
    {"DeepSpeedStrategy", "ModelParallelStrategy", "FSDPStrategy", "DDPStrategy", "SingleDeviceStrategy"}
)
_STRATEGY_NAMES = frozenset(
    {"ddp", "ddp_spawn", "ddp_fork", "deepspeed", "fsdp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3", "single_device"}
)
_STAGE_ATTR = re.compile(r"^(zero_)?stage(_\d)?$")
# Loss kinds, model kinds (preset, hf, module), inspect.Parameter kinds and probe verdicts share the word ``kind``;
# they are no strategy.
_NOT_A_STRATEGY_KIND = frozenset({"p", "loss", "_probe", "_verdict", "v", "param", "model"})
_ADAPTER_KINDS = frozenset({"lora", "qlora"})


def _names(node: ast.AST) -> set[str]:
    """Every name and attribute name in ``node``."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _owner(node: ast.AST) -> str | None:
    """``x`` of ``x.kind`` (``None`` for a deeper owner such as ``self.x.kind``, which is judged by its attribute)."""
    if isinstance(node, ast.Attribute):
        return node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
    return None


def strategy_kind_tests(source: str) -> list[tuple[int, str]]:
    """``(line, why)`` of each place in ``source`` that branches on a strategy's class, kind, ZeRO stage or name.

    Read from the syntax tree, so docstrings and comments that name a strategy class are no finding; subclassing one
    (``_compat`` gives private hooks public names that way) is none either.
    """
    tree = ast.parse(source)
    bases = {id(b) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for b in node.bases}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                classes = {n for n in _names(node.args[1]) if n.endswith("Strategy") and n != "Strategy"}
                if classes:
                    found.append((node.lineno, f"{node.func.id} on {sorted(classes)}"))
            if node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
                attr = node.args[1]
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str) and _STAGE_ATTR.match(attr.value):
                    found.append((node.lineno, f"{node.func.id} of {attr.value!r}"))
        elif isinstance(node, (ast.Name, ast.Attribute)) and id(node) not in bases:
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in _STRATEGY_CLASSES:
                found.append((node.lineno, f"uses {name}"))
            elif isinstance(node, ast.Attribute) and _STAGE_ATTR.match(name) and name != "stage":
                found.append((node.lineno, f"reads .{name}"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if _names(node) & {"LOSS_KINDS", "modules", "ADAPTER_KINDS", "_KINDS"}:
                continue  # a loss's or an adapter's kind, or `"deepspeed" in sys.modules` (is the package imported)
            if any(isinstance(c, ast.Constant) and c.value in _ADAPTER_KINDS for c in ast.walk(node)):
                continue  # an adapter's kind (adapter=none|lora|qlora): no strategy is called lora
            for side in sides:
                if isinstance(side, ast.Attribute) and side.attr == "kind" and _owner(side) not in _NOT_A_STRATEGY_KIND:
                    found.append((node.lineno, "compares .kind"))
                name = getattr(side, "attr", None) or getattr(side, "id", None)
                if name == "stage" and any(isinstance(o, ast.Constant) and isinstance(o.value, int) for o in sides):
                    found.append((node.lineno, "compares a stage"))
                constants = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                for c in constants:
                    if isinstance(c, ast.Constant) and c.value in _STRATEGY_NAMES:
                        found.append((node.lineno, f"compares with the strategy name {c.value!r}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "__name__":
                found.append((node.lineno, "tests a class name's prefix"))
    return sorted(set(found))


def test_nothing_outside_parallel_branches_on_a_strategys_kind():
    package = REPO_ROOT / "lightning_trainopt"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if rel.startswith("lightning_trainopt/parallel/"):
            continue
        if rel == "lightning_trainopt/planner/strategy_layout.py":
            continue  # where the questions are defined (from the kind and ZeRO stage)
        found += [f"{rel}:{line}: {why}" for line, why in strategy_kind_tests(path.read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        # models/hf.py before the answers moved to parallel/: a duck-typed ZeRO-3 test.
        'def f(trainer):\n    return bool(getattr(trainer.strategy, "zero_stage_3", False))\n',
        # models/lit_lm.py before: the class and the stage.
        "def f(s):\n    return isinstance(s, DeepSpeedStrategy) and not s.zero_stage_3\n",
        "def f(s):\n    return isinstance(s, (DDPStrategy, strategies.FSDPStrategy))\n",
        "def f(s):\n    return type(s) is ModelParallelStrategy\n",
        "def f(spec):\n    return spec.kind == 'deepspeed'\n",
        "def f(spec):\n    return spec.zero_stage >= 2\n",
        "def f(cfg):\n    return cfg.strategy.name in ('zero3', 'fsdp')\n",
        "def f(stage):\n    return stage < 3\n",
        "def f(s):\n    return type(s).__name__.startswith('DeepSpeed')\n",
        "def f(s):\n    return isinstance(s, TrainOptDeepSpeedStrategy)\n",
    ],
)
def test_the_kind_scan_finds_each_way_of_testing_a_strategy(snippet):
    assert strategy_kind_tests(snippet), snippet


def test_the_kind_scan_leaves_what_tests_no_strategy():
    snippet = (
        "def f(strategy, loss, p):\n"
        '    """Under DDPStrategy(ddp_comm_hook=...) the hook is kept; DeepSpeedStrategy owns its step."""\n'
        "    # isinstance(strategy, DeepSpeedStrategy) would be a finding in code, not in a comment\n"
        "    ok = isinstance(strategy, Strategy) and strategy.spec.wraps_in_engine\n"
        "    return ok and loss.kind == 'chunked' and p.kind == p.VAR_KEYWORD\n"
        "def g(spec, adapter):\n"
        "    return spec.kind == 'qlora' or adapter.kind in ('lora', 'qlora') or spec.kind not in ADAPTER_KINDS\n"
        "class Hooks(DeepSpeedStrategy):\n"
        "    pass\n"
    )
    assert strategy_kind_tests(snippet) == []


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


def test_what_each_strategy_needs_of_its_precision_plugin_is_answered_here(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_trainopt.parallel.spec import precision_needs
    from lightning_trainopt.precision import PrecisionNeeds

    def needs(name):
        got = parse_strategy(_preset(name, tmp_path)).precision_needs
        return (got.engine_precision, got.sharded_scaler, got.per_param_shards)

    assert needs("ddp") == (False, False, False)
    assert needs("zero3_offload") == needs("zero1") == (True, False, False)
    assert needs("fsdp") == (False, False, True)
    assert precision_needs(FSDPStrategy()) == PrecisionNeeds("fsdp", sharded_scaler=True)
    assert precision_needs(DDPStrategy()) == PrecisionNeeds("ddp")
    assert precision_needs("auto") == PrecisionNeeds()


def test_a_strategy_carries_its_answers_for_the_rooms_below(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.parallel import TrainOptFSDPStrategy, with_spec
    from lightning_trainopt.precision import PrecisionSpec

    ours = TrainOptFSDPStrategy()
    assert with_spec(ours).spec is ours.spec  # its own spec is kept
    stock = with_spec(DDPStrategy())
    assert (stock.spec.kind, stock.spec.wraps_in_engine, stock.spec.builds_partitioned) == ("ddp", False, False)
    bf16 = PrecisionSpec("bf16", "bf16-mixed")
    # The builder gives Lightning's own class the spec of the node it was built from.
    node = {"_target_": "lightning.pytorch.strategies.DDPStrategy", "name": "mine"}
    built = build_strategy(node, bf16, {"devices": 1})
    assert type(built) is DDPStrategy
    assert built.spec == parse_strategy(node)
    assert built.spec.name == "mine"
    preset = build_strategy(_preset("ddp", tmp_path), bf16, {"devices": 1})
    assert (preset.spec.name, preset.spec.kind) == ("ddp", "ddp")
