"""Console entry points (``trainopt-train``) and the Hydra mains that ``train.py`` re-exports."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from lightning_trainopt.app.multirun import apply_child_command
from lightning_trainopt.exceptions import TrainOptError

__all__ = ["CONFIG_DIR", "run_hydra", "train_main"]

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def _train_task(cfg: DictConfig) -> None:
    from lightning_trainopt.app.train import train

    try:
        train(cfg)
    except TrainOptError as err:
        # A user error: one clear line, no traceback; nothing saved before is touched.
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def run_hydra(task, config_name: str) -> None:  # type: ignore[no-untyped-def]
    """Run ``task`` under ``@hydra.main`` with this repository's ``conf/`` tree."""
    apply_child_command()
    hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=config_name)(task)()


def train_main() -> None:
    """``trainopt-train`` / ``python train.py``."""
    run_hydra(_train_task, "train")
