"""Run a command as on a machine where some optional packages are not installed, in every process it starts.

``sitecustomize`` runs at start-up of each Python process that has its directory on ``PYTHONPATH``, so the ranks
Lightning starts inherit it: an import of a hidden package fails there exactly as if it were not installed.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.env import child_env

_HIDE = '''
import sys


class _Hidden:
    """Import finder that reports the hidden top-level packages as not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {hidden}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Hidden())
'''


def env_without(tmp_path: Path, root: Path, *packages: str) -> dict[str, str]:
    """``child_env(root)`` plus a ``sitecustomize`` on ``PYTHONPATH`` that hides ``packages``."""
    site = tmp_path / "hide_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_HIDE.format(hidden=set(packages)))
    env = child_env(root)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return env
