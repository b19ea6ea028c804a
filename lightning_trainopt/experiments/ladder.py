"""The ladder report: one row per job of ``python train.py -m experiment=ladder``, measured beside predicted.

A Hydra callback (``hydra.callbacks.ladder_report`` in ``conf/experiment/ladder.yaml``) reads, at the end of the
multirun, each job's ``metrics.json`` (written by ``train(cfg)`` and the callbacks) and its composed config, asks the
planner for the same config (:mod:`lightning_trainopt.experiments.ladder_rows`), and writes ``ladder.md``,
``ladder.csv`` and ``ladder.png`` into the sweep directory. ``python -m lightning_trainopt.experiments.ladder
SWEEP_DIR`` writes them again from a finished sweep.
"""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_trainopt.exceptions import install_command
from lightning_trainopt.experiments.ladder_rows import (
    CALIBRATION,
    PREDICTED,
    LadderRow,
    collect_ladder,
    ladder_rungs,
    predicted_row,
)
from lightning_trainopt.experiments.sweep import status_text
from lightning_trainopt.experiments.sweep_report import SweepReport, save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "LadderReport",
    "LadderRow",
    "collect_ladder",
    "ladder_figure",
    "ladder_rungs",
    "plot_series",
    "predicted_row",
    "write_ladder_report",
]


def _plot_hint() -> str:
    """The install line for the plot, with the installed torch pinned (so pip keeps a cluster's CUDA build)."""
    return install_command("plot")


_GIB = 2**30


class _Notes:
    """Numbered footnotes, one per distinct reason, so a missing figure says why once."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def ref(self, reason: str) -> str:
        if reason not in self.reasons:
            self.reasons.append(reason)
        return f"[{self.reasons.index(reason) + 1}]"

    def mark(self, reason: str | None) -> str:
        return "-" if reason is None else f"n/a {self.ref(reason)}"

    def lines(self) -> list[str]:
        return [f"[{i}] {r}" for i, r in enumerate(self.reasons, 1)]


def _fmt(v: Any, scale: float = 1.0) -> str:
    """Three significant digits; whole numbers from 1,000 up (``2,708``, not ``2.71e+03``)."""
    if not isinstance(v, (int, float)):
        return "-"
    x = v / scale
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _err(measured: Any, predicted: Any) -> str:
    if not measured or predicted is None:
        return "-"
    return f"{predicted / measured - 1:+.1%}"


def _fits(r: LadderRow, notes: _Notes) -> str:
    if r.predicted_fits is None:
        return notes.mark(r.why_no_fits) if r.why_no_fits else "-"
    return "yes" if r.predicted_fits else "no"


def _unit(rows: list[LadderRow]) -> tuple[str, float]:
    """GiB, or MiB when every figure is below 1 GiB (a tiny model's ladder)."""
    values = [v for r in rows for v in (r.peak_memory_bytes, r.predicted_peak_bytes) if v is not None]
    return ("GiB", float(_GIB)) if max(values, default=0) >= _GIB else ("MiB", float(2**20))


def _cell(notes: _Notes, value: Any, why: str | None, scale: float = 1.0) -> str:
    """``value`` formatted, or a footnote marker saying why it is missing (``-`` when no reason is known)."""
    return _fmt(value, scale) if value is not None else notes.mark(why) if why else "-"


def _status(r: LadderRow, notes: _Notes) -> str:
    if r.status == PREDICTED:
        return "predicted (not run)"
    text = status_text(r.status, r.stopped_by, r.stopped_at_step)
    return f"{text} {notes.ref(r.error.splitlines()[0])}" if r.error else text


def _measured_table(rows: list[LadderRow], notes: _Notes) -> list[str]:
    u, scale = _unit(rows)
    lines = [
        f"| # | rung | status | fits (pred) | peak {u} (pred) | err | model states {u} (pred) | err "
        f"| activations {u} (pred) | err | tok/s/dev (pred) | err | TFLOP/s/dev | MFU | $/1B tok (pred) |",
        "|" + "---|" * 15,
    ]
    for r in rows:
        speed_err = _err(r.tokens_per_sec, r.predicted_tokens_per_sec)
        if (r.speed_source or "").startswith(CALIBRATION):
            speed_err = CALIBRATION
        pred_usd_why = r.why_no_predicted_usd or r.why_no_prediction
        cells = [
            str(r.job),
            r.rung,
            _status(r, notes),
            _fits(r, notes),
            f"{_cell(notes, r.peak_memory_bytes, r.why_no_peak, scale)} ({_fmt(r.predicted_peak_bytes, scale)})",
            _err(r.peak_memory_bytes, r.predicted_peak_bytes),
            f"{_fmt(r.model_states_bytes, scale)} ({_fmt(r.predicted_model_states_bytes, scale)})",
            _err(r.model_states_bytes, r.predicted_model_states_bytes),
            f"{_fmt(r.activations_bytes, scale)} ({_fmt(r.predicted_activations_bytes, scale)})",
            _err(r.activations_bytes, r.predicted_activations_bytes),
            f"{_fmt(r.tokens_per_sec)} ({_cell(notes, r.predicted_tokens_per_sec, r.why_no_prediction)})",
            speed_err,
            _cell(notes, r.tflops_per_device, r.why_no_tflops),
            _cell(notes, r.mfu, r.why_no_mfu),
            f"{_cell(notes, r.usd_per_1b_tokens, r.why_no_usd)} "
            f"({_cell(notes, r.predicted_usd_per_1b_tokens, pred_usd_why)})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _predicted_table(rows: list[LadderRow], notes: _Notes) -> list[str]:
    u, scale = _unit(rows)
    lines = [
        f"| # | rung | fits | margin {u} | peak {u}/device | model states {u} | activations {u} | tok/s/device "
        "| $/1B tokens |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        usd = _cell(notes, r.predicted_usd_per_1b_tokens, r.why_no_predicted_usd or r.why_no_prediction)
        cells = [
            str(r.job),
            r.rung,
            _fits(r, notes),
            _fmt(r.predicted_margin_bytes, scale),
            _fmt(r.predicted_peak_bytes, scale),
            _fmt(r.predicted_model_states_bytes, scale),
            _fmt(r.predicted_activations_bytes, scale),
            _cell(notes, r.predicted_tokens_per_sec, r.why_no_prediction),
            usd,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _present(series: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {k: v for k, v in series.items() if any(x is not None for x in v)}


def plot_series(rows: list[LadderRow]) -> dict[str, Any]:
    """What ``ladder.png`` plots: bar names and, per panel, its quantity, ``{series label: values}`` and ``limit``.

    The memory panel compares the allocator's peak where the runs measured one (CUDA) and otherwise what both sides
    count on CPU: model states + activations per device (tensor accounting). A series that has no value at all (the
    measured one of a predicted-only ladder) is left out. ``limit``: the memory the planner's ``fits`` compares the
    peak with (device memory less headroom), when the panel shows peaks and the device memory is known.
    """
    run = [r for r in rows if r.status != PREDICTED]
    if any(r.peak_memory_bytes is not None for r in run) or not run:
        mem_label = "peak memory per device"
        measured_mem = [r.peak_memory_bytes for r in rows]
        predicted_mem: list[Any] = [r.predicted_peak_bytes for r in rows]
        measured_name = "measured peak"
    else:
        mem_label = "model states + activations per device"

        def both(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a + b

        measured_mem = [both(r.model_states_bytes, r.activations_bytes) for r in rows]
        predicted_mem = [both(r.predicted_model_states_bytes, r.predicted_activations_bytes) for r in rows]
        measured_name = "measured (tensor accounting)"
    calibrated = any((r.speed_source or "").startswith("calibrat") for r in rows)
    planner = "planner (calibrated, see ladder.md)" if calibrated else "planner (predicted)"

    largest = max((v for v in (*measured_mem, *predicted_mem) if v is not None), default=0)
    unit, scale = ("GiB", _GIB) if largest >= _GIB else ("MiB", 2**20)

    def scaled(values: list[Any]) -> list[float | None]:
        return [None if v is None else v / scale for v in values]

    memory = {measured_name: scaled(measured_mem), "planner (predicted)": scaled(predicted_mem)}
    # What `fits` compares the peak with (the device memory less the headroom), when the panel shows peaks.
    usable = {
        r.predicted_peak_bytes + r.predicted_margin_bytes
        for r in rows
        if r.predicted_peak_bytes is not None and r.predicted_margin_bytes is not None
    }
    limit = usable.pop() / scale if len(usable) == 1 and mem_label.startswith("peak") else None
    speed = {"measured": [r.tokens_per_sec for r in rows], planner: [r.predicted_tokens_per_sec for r in rows]}
    return {
        "names": [r.rung if r.status in ("ok", PREDICTED) else f"{r.rung} ({r.status.upper()})" for r in rows],
        "memory": {"ylabel": f"{mem_label}, {unit}", "series": _present(memory), "limit": limit},
        "throughput": {"ylabel": "tokens/s per device", "series": _present(speed)},
    }


def ladder_figure(rows: list[LadderRow]) -> Figure:
    """The two panels of ``ladder.png`` (memory, throughput), each with its measured and predicted bars.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    data = plot_series(rows)
    x = range(len(rows))
    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2)
    for ax, (panel, title) in zip(axes, (("memory", "memory per device"), ("throughput", "throughput per device"))):
        series = data[panel]["series"]
        w = 0.8 / max(1, len(series))
        for k, (label, values) in enumerate(series.items()):
            offset = (k - (len(series) - 1) / 2) * w
            heights = [float("nan") if v is None else v for v in values]
            ax.bar([i + offset for i in x], heights, w, label=label)
        if data[panel].get("limit") is not None:
            ax.axhline(data[panel]["limit"], color="black", linestyle="--", linewidth=1, label="fits below (planner)")
        ax.set_ylabel(data[panel]["ylabel"])
        ax.set_title(title)
        ax.set_xticks(list(x))
        ax.set_xticklabels(data["names"], rotation=30, ha="right")
        if series:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no figures", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def write_ladder_report(rows: list[LadderRow], out_dir: Path) -> dict[str, Path]:
    """Write ``ladder.csv``, ``ladder.md`` and ``ladder.png`` into ``out_dir``; return the paths written.

    Without matplotlib the table and the CSV are still written; ``ladder.md`` then says how to get the plot, and the
    returned mapping has no ``png``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "ladder.csv", "md": out_dir / "ladder.md"}
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(LadderRow.__dataclass_fields__))
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    png = out_dir / "ladder.png"
    plot_note = ""
    if save_figure(lambda: ladder_figure(rows), png):
        paths["png"] = png
    else:
        plot_note = (
            f"ladder.png not written: matplotlib is not installed. {_plot_hint()}, then "
            f"python -m lightning_trainopt.experiments.ladder {out_dir} writes this report again with the plot."
        )
    notes = _Notes()
    if rows and all(r.status == PREDICTED for r in rows):
        lines = ["# Optimization ladder: predicted", "", "`plan(cfg)` for each rung; nothing was run.", ""]
        lines += _predicted_table(rows, notes)
        lines += ["", "fits: the predicted peak per device within the device memory less `plan.headroom_fraction`."]
    else:
        head = "Measured on rank 0 per device; (pred) = `plan(cfg)` for the same config."
        lines = ["# Optimization ladder", "", head, ""]
        lines += _measured_table(rows, notes)
        calibrations = [
            f"{r.compute_dtype} {r.tokens_per_sec * r.train_flops_per_token / 1e12:.3g} TFLOP/s on {r.rung}"
            for r in rows
            if (r.speed_source or "").startswith(CALIBRATION) and r.tokens_per_sec and r.train_flops_per_token
        ]
        if calibrations:
            lines += [
                "",
                "Predicted tok/s without a peak FLOP/s for the hardware: the first ok rung of each dtype is its "
                f"calibration (measured hardware FLOP/s: {', '.join(calibrations)}); the other rungs are predicted "
                "from that rate and their own FLOPs per token (recomputation included). "
                "Set +hardware.peak_tflops.<dtype>=... for the planner's own prediction.",
            ]
    if notes.reasons:
        lines += ["", *notes.lines()]
    if plot_note:
        lines += ["", plot_note]
    # Only `ok` trained as configured; the figures of a stopped, diverged or OOM rung are no result to compare.
    failed = [
        f"{r.rung} ({status_text(r.status, r.stopped_by, r.stopped_at_step)})"
        for r in rows
        if r.status not in ("ok", PREDICTED)
    ]
    if failed:
        lines += ["", f"Not a success: {', '.join(failed)}."]
    paths["md"].write_text("\n".join(lines) + "\n")
    return paths


class LadderReport(SweepReport):
    """Hydra callback writing the ladder report at the end of the multirun (rank 0 of the launching process).

    Example (in an experiment file)::

        hydra:
          callbacks:
            ladder_report:
              _target_: lightning_trainopt.experiments.ladder.LadderReport
    """

    what, png, experiment = "ladder", "ladder.png", "experiment=ladder"

    def write(self, sweep_dir: Path) -> dict[str, Path]:
        """``ladder.md``, ``.csv`` and ``.png`` of the sweep's jobs (:func:`write_ladder_report`)."""
        return write_ladder_report(collect_ladder(sweep_dir), sweep_dir)


if __name__ == "__main__":
    # python -m lightning_trainopt.experiments.ladder SWEEP_DIR: write a finished sweep's report again.
    raise SystemExit(LadderReport.main())
