"""The precision parity report: loss curves of one config in several precisions, each against the fp32 run.

``python train.py -m experiment=precision_parity`` trains the same model on the same data from the same seed in
fp32, bf16 and fp8 (one Hydra job each). The design articles' convergence check: run fp32 as the baseline and compare
the mixed-precision loss curve with it. At the end of the sweep :class:`ParityReport` writes into the sweep directory

- ``precision_parity.csv``: the training loss of every precision at every logged step;
- ``precision_parity.md``: per precision its status, final loss, and the largest and the final deviation from fp32
  (absolute and relative), over the steps both logged;
- ``precision_parity.png``: the curves side by side and their deviation from fp32 (needs matplotlib).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_trainopt.experiments.sweep_report import SweepReport, save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ParityReport", "ParityRun", "collect_parity", "deviation", "parity_figure", "write_parity_report"]

BASELINE = "fp32"
REPORT = "precision_parity"


@dataclass
class ParityRun:
    """One precision's run: its metrics.json status and its training loss by optimizer step."""

    job: str
    precision: str
    status: str
    losses: dict[int, float] = field(default_factory=dict)
    #: What ran in FP8 (metrics.json ``precision_layers``), e.g. ``29 of 29 linear layers``; empty when none did.
    fp8: str = ""


def _losses(job_dir: Path) -> dict[int, float]:
    """``train_loss`` by step from the job's CSV logs (every ``logs/version_*/metrics.csv``, later versions win)."""
    out: dict[int, float] = {}
    for path in sorted(job_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1])):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                loss, step = row.get("train_loss"), row.get("step")
                if loss and step:
                    out[int(float(step))] = float(loss)
    return dict(sorted(out.items()))


def collect_parity(sweep_dir: Path) -> list[ParityRun]:
    """One :class:`ParityRun` per job directory of the sweep, in job order."""
    runs = []
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()]
    for job in sorted(jobs, key=lambda p: (len(p.name), p.name)):
        metrics_file = job / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
        precision = str(metrics.get("precision") or _override(job, "precision") or job.name)
        run = ParityRun(job.name, precision, str(metrics.get("status", "failed")), _losses(job))
        run.fp8 = _fp8_text(metrics.get("precision_layers"))
        runs.append(run)
    return runs


def _fp8_text(layers: Any) -> str:
    if not isinstance(layers, dict) or layers.get("fp8_layers") is None:
        return ""
    fp8 = int(layers["fp8_layers"])
    total = fp8 + int(layers.get("bf16_layers") or 0)
    fraction = layers.get("fp8_weight_fraction")
    share = f", {float(fraction):.0%} of their weights" if isinstance(fraction, (int, float)) else ""
    emulated = " (emulated)" if layers.get("emulated") else ""
    return f"{fp8} of {total} linear layers{share}{emulated}"


def _override(job: Path, key: str) -> str | None:
    path = job / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        text = line.strip().lstrip("- ").strip("'\"")
        if text.startswith(f"{key}="):
            return text.split("=", 1)[1]
    return None


def deviation(run: ParityRun, baseline: ParityRun) -> dict[str, float | int | None]:
    """The run's deviation from the baseline over the steps both logged.

    Returns:
        ``steps`` compared, ``max_abs`` (the largest ``|loss - baseline|``) and its ``max_step``, ``final_abs`` and
        ``final_rel`` (at the last common step, relative to the baseline's loss); ``None`` values when no step is
        common.
    """
    common = sorted(set(run.losses) & set(baseline.losses))
    if not common:
        return {"steps": 0, "max_abs": None, "max_step": None, "final_abs": None, "final_rel": None}
    gaps = {s: abs(run.losses[s] - baseline.losses[s]) for s in common}
    worst = max(gaps, key=lambda s: gaps[s])
    last = common[-1]
    base = baseline.losses[last]
    return {
        "steps": len(common),
        "max_abs": gaps[worst],
        "max_step": worst,
        "final_abs": gaps[last],
        "final_rel": gaps[last] / abs(base) if base else None,
    }


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def _markdown(runs: list[ParityRun]) -> str:
    baseline = next((r for r in runs if r.precision == BASELINE and r.losses), None)
    lines = [
        "# Precision parity",
        "",
        f"Training loss of each precision against the {BASELINE} run (same model, data and seed), over the steps both "
        "logged.",
        "",
        "| precision | status | steps | final loss | max abs deviation (step) | final abs deviation "
        "| final rel deviation | in FP8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        final = r.losses[max(r.losses)] if r.losses else None
        if baseline is None or r is baseline:
            cells = ["baseline" if r is baseline else "no fp32 run", "", ""]
            steps = str(len(r.losses))
        else:
            d = deviation(r, baseline)
            cells = [
                f"{_fmt(d['max_abs'])} ({d['max_step']})" if d["max_abs"] is not None else "n/a",
                _fmt(d["final_abs"]),
                _fmt(d["final_rel"], ".2%"),
            ]
            steps = str(d["steps"])
        lines.append(f"| {r.precision} | {r.status} | {steps} | {_fmt(final)} | {' | '.join(cells)} | {r.fp8} |")
    if baseline is None:
        lines += ["", f"No {BASELINE} run logged a loss: include precision={BASELINE} in the sweep as the baseline."]
    if any(r.fp8.startswith("0 of") for r in runs):
        lines += ["", "An FP8 run converted no layer: it trained in bf16 (see its precision_layers in metrics.json)."]
    missing = [r.precision for r in runs if not r.losses]
    if missing:
        lines += [
            "",
            f"No training loss was logged for {', '.join(missing)} (see its train.log; a refused run has status "
            "refused). The loss comes from the CSV logger: keep logger=csv and trainer.log_every_n_steps small.",
        ]
    return "\n".join(lines) + "\n"


def _write_csv(runs: list[ParityRun], path: Path) -> None:
    steps = sorted({s for r in runs for s in r.losses})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *(r.precision for r in runs)])
        for s in steps:
            writer.writerow([s, *(r.losses.get(s, "") for r in runs)])


def parity_figure(runs: list[ParityRun]) -> Figure:
    """The two panels of ``precision_parity.png``: the loss curves, and each one's deviation from fp32's.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    baseline = next((r for r in runs if r.precision == BASELINE and r.losses), None)
    fig = Figure(figsize=(11, 4))
    curves, gaps = fig.subplots(1, 2)
    for r in runs:
        if not r.losses:
            continue
        curves.plot(list(r.losses), list(r.losses.values()), label=r.precision)
        if baseline is not None and r is not baseline:
            common = sorted(set(r.losses) & set(baseline.losses))
            gaps.plot(common, [r.losses[s] - baseline.losses[s] for s in common], label=r.precision)
    curves.set(title="training loss", xlabel="step", ylabel="loss")
    gaps.set(title=f"loss - {BASELINE} loss", xlabel="step")
    gaps.axhline(0.0, color="grey", linewidth=0.8)
    for ax in (curves, gaps):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    return fig


def write_parity_report(runs: list[ParityRun], out_dir: Path) -> dict[str, Path]:
    """Write ``precision_parity.md``, ``.csv`` and (with matplotlib) ``.png`` into ``out_dir``; their paths."""
    paths = {"md": out_dir / f"{REPORT}.md", "csv": out_dir / f"{REPORT}.csv"}
    paths["md"].write_text(_markdown(runs))
    _write_csv(runs, paths["csv"])
    if save_figure(lambda: parity_figure(runs), out_dir / f"{REPORT}.png", dpi=120):
        paths["png"] = out_dir / f"{REPORT}.png"
    return paths


class ParityReport(SweepReport):
    """Hydra callback writing the precision parity report at the end of the multirun (the launching process).

    Example (in an experiment file)::

        hydra:
          callbacks:
            parity_report:
              _target_: lightning_trainopt.experiments.parity.ParityReport
    """

    what, png, experiment = "precision parity", f"{REPORT}.png", "experiment=precision_parity"

    def write(self, sweep_dir: Path) -> dict[str, Path]:
        """``precision_parity.md``, ``.csv`` and ``.png`` of the sweep's jobs (:func:`write_parity_report`)."""
        return write_parity_report(collect_parity(sweep_dir), sweep_dir)


if __name__ == "__main__":
    # python -m lightning_trainopt.experiments.parity SWEEP_DIR: write a finished sweep's report again.
    raise SystemExit(ParityReport.main())
