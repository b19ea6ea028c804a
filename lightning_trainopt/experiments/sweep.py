"""Hydra callback that writes ``sweep_summary.md`` and ``sweep_summary.csv`` at the end of a multirun."""

from __future__ import annotations

import csv
import json
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = ["SweepSummary", "collect_jobs", "no_job_succeeded", "status_text", "write_sweep_report", "write_summary"]

log = logging.getLogger(__name__)

COLUMNS = (
    "job",
    "overrides",
    "status",
    "model",
    "strategy",
    "zero_stage",
    "precision",
    "world_size",
    "global_step",
    "train_loss",
    "val_loss",
    "tokens_per_sec",
    "wall_seconds",
)


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of the sweep: its overrides and its metrics.json (status ``missing`` if none)."""
    rows = []
    job_dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()]
    for job in sorted(job_dirs, key=lambda p: (len(p.name), p.name)):
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
        metrics_file = job / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {"status": "missing"}
        rows.append({"job": job.name, "overrides": " ".join(map(str, overrides or [])), **metrics})
    return rows


def status_text(status: Any, stopped_by: Any = None, stopped_at_step: Any = None) -> str:
    """A metrics.json ``status`` as a report shows it: ``stopped`` names the callback and the step.

    ``ok`` is the only success; ``stopped`` (a callback such as ``NonFiniteGuard`` ended the fit early),
    ``diverged`` (the final train loss is not finite), ``oom``, ``refused`` and ``missing`` (no metrics.json) are not.
    """
    text = str(status)
    if status == "stopped":
        who = stopped_by or "a callback"
        text += f" ({who} at step {stopped_at_step})" if stopped_at_step is not None else f" ({who})"
    return text


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_summary(sweep_dir: Path) -> tuple[Path, Path]:
    """Write the markdown and CSV summaries of ``sweep_dir``; return their paths."""
    rows = collect_jobs(sweep_dir)
    extra = sorted({k for r in rows for k, v in r.items() if k not in COLUMNS and not isinstance(v, (dict, list))})
    columns = [*COLUMNS, *extra]
    csv_path = sweep_dir / "sweep_summary.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c) for c in columns})
    md_path = sweep_dir / "sweep_summary.md"
    lines = [f"# Sweep summary: {sweep_dir}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = {c: _cell(r.get(c)) for c in COLUMNS}
        cells["status"] = status_text(r.get("status"), r.get("stopped_by"), r.get("stopped_at_step"))
        lines.append("| " + " | ".join(cells[c] for c in COLUMNS) + " |")
    counts = Counter(str(r.get("status")) for r in rows)
    tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: (kv[0] != "ok", kv[0])))
    lines += ["", f"{len(rows)} job(s): {tally or 'none'}; every metrics.json column is in {csv_path.name}.", ""]
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["Errors:", ""]
        lines += [f"- job {r['job']} ({r.get('status')}): {' '.join(str(r['error']).split())}" for r in errors]
        lines.append("")
    md_path.write_text("\n".join(lines))
    return md_path, csv_path


def _succeeded(row: dict[str, Any]) -> bool:
    """``ok``, or stopped by Lightning's ``EarlyStopping``: the fit ended as its config asked (``NonFiniteGuard``'s
    stop is a failure)."""
    status = row.get("status")
    return status == "ok" or (status == "stopped" and row.get("stopped_by") == "EarlyStopping")


def no_job_succeeded(rows: list[dict[str, Any]]) -> bool:
    """Jobs ran and recorded their outcome in a metrics.json, and none of them succeeded (:func:`_succeeded`).

    A sweep whose jobs write no metrics.json (``plan.py -m``: a planned job prints its plan) is not judged here.
    """
    recorded = [r for r in rows if r.get("status") != "missing"]
    return bool(recorded) and not any(_succeeded(r) for r in recorded)


class SweepSummary(Callback):
    """Registered under ``hydra.callbacks`` in ``conf/hydra/default.yaml``; fires once, in the sweep's own process.

    Writes the summary, then ends the sweep with exit code 2 (as a refused single run, and as ``plan.py -m``)
    when no job succeeded: every job was refused, failed, stopped, diverged or ran out of memory. A sweep without
    job directories of its own (``plan.py -m`` keeps no ``.hydra/`` record per job) gets no summary.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir) if sweep_dir.is_dir() else []
        if not rows:
            return
        md, _ = write_summary(sweep_dir)
        log.info("sweep summary written to %s", md)
        if no_job_succeeded(rows):
            tally = ", ".join(f"job {r['job']} {status_text(r.get('status'))}" for r in rows)
            print(f"error: no job of the sweep succeeded ({tally}); see {md}", file=sys.stderr)
            # Hydra turns a callback's exception into a warning; SystemExit passes its handler and sets the status.
            raise SystemExit(2)


def write_sweep_report(config: DictConfig, what: str, write: Any) -> dict[str, Path] | None:
    """A report experiment's ``on_multirun_end``: ``write(sweep_dir)`` in the launching process, printed.

    A DDP child re-running the command writes nothing (``None``). Hydra turns a callback's exception into a warning
    and exits 0; an experiment without its report is a failed run, so a failure becomes ``SystemExit`` (not an
    ``Exception``: it passes Hydra's handler and sets the exit status).

    Args:
        config: the multirun's config (``hydra.sweep.dir``).
        what: the report's name in messages (``ladder``, ``precision parity``).
        write: ``sweep_dir -> {"md": path, ...}``, the paths it wrote.
    """
    import os

    if int(os.environ.get("LOCAL_RANK", "0")) or int(os.environ.get("NODE_RANK", "0")):
        return None
    sweep_dir = Path(config.hydra.sweep.dir)
    if not sweep_dir.is_dir():
        return None
    try:
        paths: dict[str, Path] = write(sweep_dir)
    except Exception as err:
        log.exception("the %s report could not be written", what)
        raise SystemExit(f"error: {what} report not written ({type(err).__name__}: {err})") from err
    print(paths["md"].read_text())
    print(f"{what} report: {', '.join(str(p) for p in paths.values())}")
    return paths
