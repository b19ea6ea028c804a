"""SweepReport: what the experiments' end-of-sweep reports share (the ladder's, the precision parity's).

Each report is a Hydra callback that writes its files into the sweep directory at the end of the multirun, can write
them again from a finished sweep (``python -m <its module> SWEEP_DIR``), and draws its PNG with matplotlib when it is
installed (the Markdown and CSV files are written without it).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_trainopt.exceptions import install_command
from lightning_trainopt.experiments.sweep import write_sweep_report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["SweepReport", "save_figure"]

log = logging.getLogger(__name__)


def save_figure(make: Callable[[], Figure], path: Path, dpi: int = 110) -> bool:
    """Write the figure ``make()`` draws to ``path``; ``False`` (nothing written) when matplotlib is not installed.

    Args:
        make: builds a ``matplotlib.figure.Figure`` (not pyplot's: no backend, no global figure to close), and
            raises ``ImportError`` without matplotlib.
        path: the PNG to write.
        dpi: its resolution.
    """
    try:
        figure = make()
    except ImportError:
        return False
    figure.savefig(path, dpi=dpi)
    return True


class SweepReport(Callback):
    """A Hydra callback that writes a sweep's report at the end of the multirun (rank 0 of the launching process).

    A subclass names its report and writes it: ``what`` (its name in messages), ``png`` (the plot's file name),
    ``experiment`` (the sweep it reads, for the usage line) and :meth:`write`. :meth:`main` writes the report of a
    finished sweep again.

    Example::

        class LadderReport(SweepReport):
            what, png, experiment = "ladder", "ladder.png", "experiment=ladder"

            def write(self, sweep_dir: Path) -> dict[str, Path]:
                return write_ladder_report(collect_ladder(sweep_dir), sweep_dir)
    """

    what: ClassVar[str]
    png: ClassVar[str]
    experiment: ClassVar[str]

    def write(self, sweep_dir: Path) -> dict[str, Path]:
        """Write the report's files into ``sweep_dir``; ``{"md": path, "csv": path, "png": path (with matplotlib)}``."""
        raise NotImplementedError(f"{type(self).__name__} must write its report")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        paths = write_sweep_report(config, self.what, self.write)
        if paths is not None and "png" not in paths:
            log.warning("%s not written: matplotlib is not installed: %s", self.png, install_command("plot"))

    @classmethod
    def main(cls, argv: list[str] | None = None) -> int:
        """``python -m <module> SWEEP_DIR``: write a finished sweep's report again and print it; the exit status."""
        args = sys.argv[1:] if argv is None else argv
        if len(args) != 1 or not Path(args[0]).is_dir():
            print(f"usage: python -m {cls.__module__} SWEEP_DIR (the sweep directory of {cls.experiment})")
            return 2
        paths = cls().write(Path(args[0]))
        print(paths["md"].read_text())
        print(f"{cls.what} report: {', '.join(str(p) for p in paths.values())}")
        return 0
