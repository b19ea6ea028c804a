"""Environment for child processes that import the package from the repository root."""

from __future__ import annotations

import os
from pathlib import Path


def child_env(root: str | Path, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``root`` put first on ``PYTHONPATH``, keeping what was there.

    Replacing ``PYTHONPATH`` would drop packages installed outside site-packages (the GPU check script puts Hydra,
    OmegaConf and DeepSpeed on ``PYTHONPATH`` of a bare image), so a child would fail where its parent imports fine.
    """
    paths = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}
