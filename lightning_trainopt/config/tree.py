"""Where the Hydra config tree lives: ``lightning_trainopt/conf``, shipped inside the package as data."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["CONF_DIR"]

#: The package's own config tree. ``importlib.resources`` finds it in a checkout, an editable install and a wheel
#: alike (a wheel installs the package as plain files, so the traversable is a real directory).
CONF_DIR: Path = Path(str(files("lightning_trainopt") / "conf"))
