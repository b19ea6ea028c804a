"""The package as a user installs it: the wheel in a fresh virtual environment, run from an unrelated directory.

The wheel is built from a copy of the checkout (``pip wheel --no-deps --no-build-isolation``; a build in place would
reuse a stale ``build/``), installed with ``--no-deps`` into a venv that reuses the system site-packages for torch,
Lightning and Hydra, and run through its console scripts ``trainopt-plan`` and ``trainopt-train``: the config tree
must come from the installed package (``lightning_trainopt/conf``), not from a checkout. A user's own config
directory adds presets through ``--config-dir`` or ``hydra.searchpath``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.models import GPT, GPTConfig
from tests.helpers.compose import REPO_ROOT

pytestmark = pytest.mark.slow

# What a checkout holds beside the sources: none of it belongs in the wheel, and a stale build/ would leak into it.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "outputs", "multirun", "lightning_logs"
)
# The short run: 3 optimizer steps, one validation batch, no progress bar or logger files.
SHORT = ("trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "logger=none")
# A user's preset: the shipped gpt_tiny, narrower and shallower.
MY_TINY = """\
defaults:
  - gpt_tiny
  - _self_
name: my_tiny
n_layers: 2
d_model: 64
ffn_hidden: 176
"""


def _env() -> dict[str, str]:
    """This environment without the checkout on ``PYTHONPATH`` (other entries stay: a bare image puts Hydra there)."""
    root = str(REPO_ROOT)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(root)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PIP_NO_INDEX": "1", "COLUMNS": "250"}


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the freshly built wheel installed; returns its ``bin`` directory."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO_ROOT, source, ignore=_NOT_SOURCES)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", ".", "-w", str(root)], source)
    (wheel,) = root.glob("lightning_trainopt-*.whl")
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], root)
    bin_dir = root / "venv" / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], root)
    return bin_dir


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """An unrelated working directory: no train.py, no conf/."""
    work = tmp_path / "work"
    work.mkdir()
    return work


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    conf = tmp_path / "my_conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "my_tiny.yaml").write_text(MY_TINY)
    return conf


def test_the_venv_imports_the_wheel_with_its_config_tree(venv, elsewhere):
    proc = _run(
        [
            str(venv / "python"),
            "-c",
            "import lightning_trainopt; from lightning_trainopt.config.tree import CONF_DIR; "
            "print(lightning_trainopt.__file__); print(CONF_DIR)",
        ],
        elsewhere,
    )
    package_file, conf_dir = proc.stdout.split()
    site = venv.parent / "lib"
    assert Path(package_file).is_relative_to(site), package_file  # the wheel's copy, not the editable checkout
    shipped = {p.relative_to(conf_dir) for p in Path(conf_dir).rglob("*.yaml")}
    source = {
        p.relative_to(REPO_ROOT / "lightning_trainopt" / "conf")
        for p in (REPO_ROOT / "lightning_trainopt" / "conf").rglob("*.yaml")
    }
    assert shipped == source


def test_trainopt_plan_runs_from_an_unrelated_directory(venv, elsewhere):
    proc = _run([str(venv / "trainopt-plan"), f"hydra.run.dir={elsewhere / 'plan'}"], elsewhere)
    assert "run it: trainopt-train model=gpt_tiny" in proc.stdout


def test_trainopt_train_runs_3_steps_from_an_unrelated_directory(venv, elsewhere):
    run_dir = elsewhere / "run"
    _run([str(venv / "trainopt-train"), *SHORT, f"hydra.run.dir={run_dir}"], elsewhere)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["status"], metrics["model"], metrics["global_step"]) == ("ok", "gpt_tiny", 3)
    assert metrics["train_loss"] < 6.0  # a working step on bytes starts near ln(256) = 5.5
    # Hydra's record of the run names the installed config tree as the main source.
    hydra_record = (run_dir / ".hydra" / "hydra.yaml").read_text()
    assert str(venv.parent / "lib") in hydra_record


def test_a_user_preset_from_config_dir_trains(venv, elsewhere, user_conf):
    run_dir = elsewhere / "run"
    _run(
        [
            str(venv / "trainopt-train"),
            "--config-dir",
            str(user_conf),
            "model=my_tiny",
            *SHORT,
            f"hydra.run.dir={run_dir}",
        ],
        elsewhere,
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["status"], metrics["model"], metrics["global_step"]) == ("ok", "my_tiny", 3)
    preset = OmegaConf.to_container(
        OmegaConf.load(REPO_ROOT / "lightning_trainopt" / "conf" / "model" / "gpt_tiny.yaml")
    )
    assert isinstance(preset, dict)
    preset.update(OmegaConf.to_container(OmegaConf.create(MY_TINY)))  # type: ignore[arg-type]
    mine = GPTConfig(**{k: v for k, v in preset.items() if k not in ("_target_", "name", "defaults")})
    assert metrics["n_params"] == sum(p.numel() for p in GPT(mine).parameters())


def test_a_user_preset_from_hydra_searchpath_is_planned_with_a_command_that_finds_it(venv, elsewhere, user_conf):
    searchpath = f"hydra.searchpath=[file://{user_conf}]"
    proc = _run(
        [str(venv / "trainopt-plan"), searchpath, "model=my_tiny", f"hydra.run.dir={elsewhere / 'plan'}"], elsewhere
    )
    assert f"run it: trainopt-train '{searchpath}' model=my_tiny" in proc.stdout
