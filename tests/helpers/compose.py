"""Compose the project's Hydra configs in tests, with Hydra's runtime set as a real run would have it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from lightning_trainopt.launch.cli import CONFIG_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Overrides of a seconds-long train.py run for subprocess tests: a 2-layer model on synthetic tokens, no callbacks.
SMALL_RUN = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.ffn_hidden=128",
    "data.seq_len=32",
    "data.batch_size=4",
    "data=synthetic",
    "trainer.limit_val_batches=2",
    "scheduler.warmup_steps=2",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
]

# A model and run small enough for a fit to take seconds on one CPU core.
TINY = (
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.ffn_hidden=128",
    "data.seq_len=32",
    "data.batch_size=4",
    "trainer.max_steps=4",
    "scheduler.warmup_steps=1",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "logger=none",
)


def compose_config(overrides: Sequence[str] = (), output_dir: Path | None = None, name: str = "train") -> DictConfig:
    """Compose ``conf/<name>.yaml`` with ``overrides`` and register it as Hydra's current config."""
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir or Path.cwd())
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg
