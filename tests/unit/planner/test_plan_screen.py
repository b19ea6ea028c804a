"""What a first-time user reads on plan.py's screen: the planned seq_len, the FLOP figures, distinct search rows."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from lightning_trainopt.config.plan import PlanResult, plan
from lightning_trainopt.planner.report import print_plan
from tests.helpers.compose import REPO_ROOT, compose_config

ZERO2 = ["model=llama_7b", "hardware=a100_80gb", "trainer.devices=4", "+strategy=zero2", "precision=bf16"]
# A small search with several micro-batches per configuration (8 sequences per device per step).
SEARCH = [
    "model=gpt_125m",
    "hardware=a100_80gb",
    "trainer.devices=4",
    "precision=bf16",
    "data.batch_size=8",
    "plan.search=true",
    "plan.search_space.precision=[bf16]",
    "plan.search_space.strategy=[zero1,zero2]",
    "plan.search_space.activations=[none,checkpoint]",
    "plan.search_space.optimizer=[adamw]",
    "plan.search_space.micro_batch=[1,2,4,8]",
]
# User-facing text must say where a figure comes from, not which ticket or audit note changed it.
TICKET = re.compile(r"\bissues?\s*#?\d|\baudit\b|#\d", re.IGNORECASE)


def _screen(result: PlanResult) -> str:
    buf = io.StringIO()
    print_plan(result, console=Console(file=buf, width=400, color_system=None))
    return buf.getvalue()


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, PlanResult]:
    tmp = tmp_path_factory.mktemp("plan")
    runs = {
        "default_len": [*ZERO2, "activations=checkpoint"],
        "set_len": [*ZERO2, "activations=checkpoint", "data.seq_len=4096", "data.batch_size=1"],
        "set_default_len": [*ZERO2, "data.seq_len=128"],
        "tiny": ["model=gpt_tiny", "hardware=a100_80gb"],
        "search": SEARCH,
    }
    # compose_config sets Hydra's global config, which plan() reads: compose and plan one at a time.
    return {name: plan(compose_config(overrides, tmp, name="plan")) for name, overrides in runs.items()}


def test_the_data_default_seq_len_is_in_the_headline_with_a_note(planned):
    result = planned["default_len"]
    screen = _screen(result)
    headline = screen.splitlines()[0]
    assert "llama_7b (6.738B params) at seq_len 128 (data=stdlib_text default) on 4 x a100_80gb" in headline
    note = screen.splitlines()[1]
    assert note.startswith("note: seq_len 128 is the default of data=stdlib_text")
    assert "up to 4096 tokens (model.max_seq_len)" in note
    assert "data.seq_len=4096" in note
    d = result.to_dict()
    assert d["seq_len"] == 128
    assert d["seq_len_default"] is True
    assert d["seq_len_note"] == result.seq_len_note == note.removeprefix("note: ")
    assert d["peak_bytes"] == 50_587_140_104  # the default length itself is unchanged


def test_a_seq_len_the_user_sets_is_in_the_headline_without_a_note(planned):
    for name, length in (("set_len", 4096), ("set_default_len", 128)):
        result = planned[name]
        headline = _screen(result).splitlines()[0]
        assert f"at seq_len {length} on 4 x a100_80gb" in headline, name
        assert "default" not in headline, name
        assert "note:" not in _screen(result), name
        assert result.to_dict()["seq_len_default"] is False, name
        assert result.to_dict()["seq_len_note"] is None, name


def test_a_default_seq_len_near_the_models_context_gets_no_note(planned):
    # gpt_tiny trains at the demo data's 128 of its 512 tokens: the headline says it, no note.
    result = planned["tiny"]
    assert "at seq_len 128 (data=stdlib_text default)" in _screen(result).splitlines()[0]
    assert result.seq_len_note == ""
    assert "note:" not in _screen(result)


def test_a_seq_len_set_in_python_is_not_called_the_default(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from lightning_trainopt.launch.cli import CONFIG_DIR

    HydraConfig.instance().cfg = None  # a notebook: no @hydra.main, no overrides recorded
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
        cfg = compose("plan", overrides=ZERO2)
    assert plan(cfg).seq_len_default_of == "stdlib_text"
    cfg.data.seq_len = 2048
    result = plan(cfg)
    assert result.seq_len_default_of == ""
    assert result.seq_len_note == ""


def _speed_line(screen: str) -> str:
    return next(line for line in screen.splitlines() if line.startswith("speed: "))


def test_the_speed_line_names_model_recomputed_and_executed_flops_once_each(planned):
    result = planned["default_len"]
    i, e = result.estimate.inputs, result.estimate
    m = i.model
    # Matmul FLOPs x 3 (forward + backward): every weight matrix but the embedding lookup, plus attention's T x T.
    model = 6 * (m.n_params() - m.vocab_size * m.d_model - (2 * m.n_layers + 1) * m.d_model)
    model += 12 * m.n_layers * i.seq_len * m.d_model
    d = result.to_dict()
    assert d["model_flops_per_token"] == model
    assert d["train_flops_per_token"] == e.train_flops_per_token > model  # checkpointing replays the forward
    line = _speed_line(_screen(result))
    figures = re.findall(r"(\d\.\d\de\+\d\d)", line)
    executed = e.train_flops_per_token
    assert figures == [f"{model:#.3g}", f"{executed - model:#.3g}", f"{executed:#.3g}"]
    assert f"{model:#.3g} model FLOP/token (forward + backward)" in line
    assert f"recomputed by activation checkpointing = {executed:#.3g} FLOP/token executed" in line
    assert "compute at 40% (plan.hfu, of the FLOPs executed) of the 312 TFLOP/s dense bf16 peak" in line


def test_without_recomputation_the_speed_line_gives_one_flop_figure(planned):
    result = planned["set_default_len"]
    e = result.estimate
    assert e.train_flops_per_token == result.to_dict()["model_flops_per_token"]
    line = _speed_line(_screen(result))
    assert re.findall(r"(\d\.\d\de\+\d\d)", line) == [f"{e.train_flops_per_token:#.3g}"]
    assert "nothing recomputed" in line


def _table_rows(screen: str) -> list[list[str]]:
    rows = []
    for line in screen.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].isdigit():
            rows.append(cells)
    return rows


def test_the_search_shows_distinct_configurations_each_at_its_best_micro_batch(planned):
    result = planned["search"]
    configs = [tuple(sorted(c.choices.items())) for c in result.candidates]
    # zero1/zero2 x none/checkpoint at 4 micro-batches each: 4 configurations, 16 estimates.
    assert len(configs) == len(set(configs)) == 4
    assert result.n_enumerated == 16
    for c in result.candidates:
        i = c.estimate.inputs
        assert (i.micro_batch, i.accumulate) == (8, 1)  # the FLOPs model ties: the largest micro-batch wins
    screen = _screen(result)
    assert "search: 4 configurations fit (16 estimates of" in screen
    rows = _table_rows(screen)
    top = result.to_dict()["search"]
    assert top["n_fit"] == 4
    assert top["n_enumerated"] == 16
    assert len(rows) == len(top["top"]) == 4
    for row, entry in zip(rows, top["top"], strict=True):
        ch = entry["choices"]
        assert row[1:9] == [
            ch["precision"],
            ch["strategy"],
            ch["activations"],
            ch["optimizer"],
            str(entry["tensor_parallel"]),
            "-",  # SP: no TP
            "-",  # HSDP: no replicas
            f"{entry['micro_batch']} x {entry['accumulate']}",
        ]
    assert result.winner is result.candidates[0]
    assert f"data.batch_size={result.winner.estimate.inputs.micro_batch}" in result.command


def test_no_ticket_references_on_the_screen_or_in_the_planning_docs(planned):
    for name, result in planned.items():
        screen = _screen(result)
        assert not TICKET.search(screen), (name, TICKET.search(screen))
        assert not TICKET.search(str(result.to_dict())), name
    for path in [
        REPO_ROOT / "docs" / "planning.md",
        *sorted(Path(REPO_ROOT / "lightning_trainopt" / "conf").rglob("*.yaml")),
    ]:
        found = [line for line in path.read_text().splitlines() if TICKET.search(line)]
        assert not found, (path, found)
