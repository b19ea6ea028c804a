"""Read a user's own DeepSpeed JSON config, reporting problems with the config key that pointed at it."""

from __future__ import annotations

import json
import os
from typing import Any

from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError

__all__ = ["check_json_precision", "load_deepspeed_json"]


def load_deepspeed_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load ``strategy.config`` (a DeepSpeed JSON file) as a dict, unchanged.

    Raises:
        ConfigError: the file is missing, unreadable, not JSON, or not a JSON object.
    """
    key = "strategy.config"
    if not os.path.isfile(path):
        raise ConfigError(
            key,
            str(path),
            "point it at an existing DeepSpeed JSON file (absolute, or relative to the launch directory).",
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(key, str(path), f"the file is not valid JSON ({err}); fix the file.") from err
    if not isinstance(data, dict):
        raise ConfigError(
            key, str(path), 'the file must hold a JSON object such as {"zero_optimization": {"stage": 2}}.'
        )
    return data


def check_json_precision(config: dict[str, Any], trainer_precision: str) -> None:
    """Refuse an ``fp16``/``bf16`` block of a DeepSpeed config that the Trainer precision contradicts.

    Shared by the strategy (at set-up) and the planner, so both refuse the same JSON.

    Raises:
        IncompatibleConfigError: the block is enabled but the precision is another one.
    """
    wants = {"fp16": trainer_precision.startswith("16"), "bf16": trainer_precision.startswith("bf16")}
    for key, wanted in wants.items():
        node = config.get(key)
        if isinstance(node, dict) and node.get("enabled", False) and not wanted:
            raise IncompatibleConfigError(
                {f"strategy.config.{key}.enabled": True, "precision": trainer_precision},
                f"the DeepSpeed config enables {key} but the Trainer precision is {trainer_precision!r}; the two "
                "would disagree on the dtype of weights and inputs.",
                f"remove the {key!r} block from the DeepSpeed JSON (the precision preset sets it) or pick the "
                "matching precision preset.",
            )
