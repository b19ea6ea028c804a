"""prepare.py / trainopt-prepare: the Hydra tree (conf/prepare.yaml, conf/tokenizer/), its summary and its refusals."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.launch.cli import user_error
from lightning_trainopt.launch.prepare_cli import prepare, prepare_main
from tests.helpers.compose import REPO_ROOT, compose_config
from tests.helpers.prepared import STDLIB


def test_the_console_script_is_the_hydra_entry():
    script = re.search(r'^trainopt-prepare = "(.+)"$', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert script is not None
    module, _, name = script.group(1).partition(":")
    assert getattr(importlib.import_module(module), name) is prepare_main


def test_prepare_from_the_config_tree_prints_the_train_command(tmp_path, capsys):
    out = tmp_path / "out"
    overrides = [f"input={STDLIB / 'json' / '*.py'}", f"output={out}", "tokenizer.vocab_size=300", "progress=false"]
    manifest = prepare(compose_config(overrides, tmp_path, name="prepare"))
    printed = capsys.readouterr().out
    assert f"{out}: prepared: {manifest.tokens:,} tokens in 5 documents" in printed
    assert f"python train.py data=tokenized data.path={out}" in printed
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_size"] == 300
    prepare(compose_config(overrides, tmp_path, name="prepare"))
    assert "already prepared, nothing to do" in capsys.readouterr().out


def test_a_list_of_inputs_in_order(tmp_path):
    out = tmp_path / "out"
    files = [STDLIB / "json" / "tool.py", STDLIB / "json" / "scanner.py"]
    overrides = [f"input=[{files[0]},{files[1]}]", f"output={out}", "tokenizer.vocab_size=300", "progress=false"]
    manifest = prepare(compose_config(overrides, tmp_path, name="prepare"))
    assert [f["path"] for f in manifest.config["input"]] == [str(f.resolve()) for f in files]


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "tokenizer.vocab_size=100",
            "error: tokenizer.vocab_size=100 is invalid: a byte-level BPE needs at least 257 ids",
        ),
        ("text_colum=body", "error: text_colum=body: no such key; did you mean text_column?"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(tmp_path, override, line):
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "prepare.py"),
            f"input={STDLIB / 'json' / 'tool.py'}",
            f"output={out}",
            override,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().startswith(line), run.stderr
    assert list(tmp_path.iterdir()) == []  # neither the output nor a Hydra run folder


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([], "input"),
        ([f"input={STDLIB / 'json' / 'tool.py'}", "tokenizer=local"], "tokenizer.path"),
        ([f"input={STDLIB / 'json' / 'tool.py'}", "+tokenizer.vocab=3"], "tokenizer.vocab"),
    ],
)
def test_bad_config_names_the_key(tmp_path, overrides, key):
    out = tmp_path / "out"
    with pytest.raises(Exception) as err:  # noqa: PT011  # Hydra wraps what the tokenizer's __init__ raises
        prepare(compose_config([f"output={out}", *overrides], tmp_path, name="prepare"))
    found = user_error(err.value)
    assert isinstance(found, ConfigError)
    assert found.key == key
    assert not out.exists()
