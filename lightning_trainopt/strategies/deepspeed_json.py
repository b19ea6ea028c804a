"""Read a user's own DeepSpeed JSON config, reporting problems with the config key that pointed at it."""

from __future__ import annotations

import json
import os
from typing import Any

from lightning_trainopt.exceptions import ConfigError

__all__ = ["load_deepspeed_json"]


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
