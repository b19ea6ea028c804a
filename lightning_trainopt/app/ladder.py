"""The ladder report: one row per job of ``python train.py -m experiment=ladder``, measured beside predicted.

A Hydra callback (``hydra.callbacks.ladder_report`` in ``conf/experiment/ladder.yaml``) reads, at the end of the
multirun, each job's ``metrics.json`` (written by ``train(cfg)`` and the callbacks) and its composed config, asks the
planner for the same config, and writes ``ladder.md``, ``ladder.csv`` and ``ladder.png`` into the sweep directory.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.app.sweep import status_text
from lightning_trainopt.exceptions import TrainOptError

__all__ = ["LadderReport", "LadderRow", "collect_ladder", "write_ladder_report"]

log = logging.getLogger(__name__)

RUNG_KEY = "experiment/ladder_rung"
_GIB = 2**30


@dataclass
class LadderRow:
    """One rung: what was measured and what the planner predicted for the same config.

    Args:
        job: Hydra job number.
        rung: the rung's name (``conf/experiment/ladder_rung/<rung>.yaml``).
        status: metrics.json's: ``ok`` (the only success), ``stopped`` (a callback ended the fit early),
            ``diverged`` (the final train loss is not finite), ``oom``, ``refused``; ``failed`` without metrics.json.
        peak_memory_bytes: measured peak per device.
        predicted_peak_bytes: the planner's per-device total.
        model_states_bytes: measured params + grads + optimizer states on the device (rank 0).
        predicted_model_states_bytes: the planner's.
        activations_bytes: measured bytes saved for backward (rank 0, ``memory_breakdown.activations``).
        predicted_activations_bytes: the planner's.
        tokens_per_sec: measured tokens/s per device.
        predicted_tokens_per_sec: the planner's (``None`` without a peak for the hardware).
        tflops_per_device: measured model TFLOP/s per device.
        mfu: measured model FLOPs utilisation.
        usd_per_1b_tokens: measured dollars per 1e9 tokens.
        predicted_usd_per_1b_tokens: the planner's.
        stopped_by: the callback that stopped the fit (``stopped`` only; ``None`` if unknown).
        stopped_at_step: the optimizer step it stopped at.
    """

    job: int
    rung: str
    status: str
    peak_memory_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    model_states_bytes: int | None = None
    predicted_model_states_bytes: int | None = None
    activations_bytes: int | None = None
    predicted_activations_bytes: int | None = None
    tokens_per_sec: float | None = None
    predicted_tokens_per_sec: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    usd_per_1b_tokens: float | None = None
    predicted_usd_per_1b_tokens: float | None = None
    stopped_by: str | None = None
    stopped_at_step: int | None = None


def _device_states(breakdown: Any) -> int | None:
    if not isinstance(breakdown, dict):
        return None
    total = 0
    for cat in ("params", "grads", "optimizer_states"):
        v = breakdown.get(cat)
        if isinstance(v, dict):
            total += int(v.get("device") or 0)
        elif isinstance(v, (int, float)):
            total += int(v)
        else:
            return None
    return total


def _per_device_tps(metrics: dict[str, Any]) -> float | None:
    if metrics.get("tokens_per_sec_per_device") is not None:
        return float(metrics["tokens_per_sec_per_device"])
    if metrics.get("tokens_per_sec") is not None:
        return float(metrics["tokens_per_sec"]) / int(metrics.get("world_size") or 1)
    return None


def _predict(cfg: DictConfig, row: LadderRow) -> None:
    from lightning_trainopt.app.plan import plan

    OmegaConf.set_struct(cfg, False)
    cfg.plan = OmegaConf.create({"choices": {}})
    result = plan(cfg)
    e = result.estimate
    row.predicted_peak_bytes = e.peak_device_bytes
    row.predicted_model_states_bytes = sum(
        e.memory.bytes(c, resident_only=True) for c in ("params", "grads", "optimizer_states")
    )
    row.predicted_activations_bytes = e.memory.bytes("activations")
    row.predicted_tokens_per_sec = e.speed.tokens_per_sec_per_device
    row.predicted_usd_per_1b_tokens = e.speed.usd_per_1b_tokens


def collect_ladder(sweep_dir: Path) -> list[LadderRow]:
    """Rows of every job directory under ``sweep_dir`` (those with a ``.hydra/config.yaml``), by job number."""
    rows: list[LadderRow] = []
    for job_dir in sorted(
        (p for p in Path(sweep_dir).iterdir() if (p / ".hydra" / "config.yaml").is_file()),
        key=lambda p: int(p.name) if p.name.isdigit() else 0,
    ):
        hydra_cfg = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml")
        choices = hydra_cfg.hydra.runtime.choices
        rung = str(choices.get(RUNG_KEY) or job_dir.name)
        metrics_file = job_dir / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
        row = LadderRow(
            job=int(job_dir.name) if job_dir.name.isdigit() else len(rows),
            rung=rung,
            status=str(metrics.get("status", "failed")) if metrics else "failed",
            peak_memory_bytes=metrics.get("peak_memory_bytes"),
            model_states_bytes=_device_states(metrics.get("memory_breakdown")),
            activations_bytes=(metrics.get("memory_breakdown") or {}).get("activations"),
            tokens_per_sec=_per_device_tps(metrics),
            tflops_per_device=metrics.get("tflops_per_device"),
            mfu=metrics.get("mfu"),
            usd_per_1b_tokens=metrics.get("usd_per_1b_tokens"),
            stopped_by=metrics.get("stopped_by"),
            stopped_at_step=metrics.get("stopped_at_step"),
        )
        cfg = OmegaConf.load(job_dir / ".hydra" / "config.yaml")
        try:
            if isinstance(cfg, DictConfig):
                _predict(cfg, row)
        except TrainOptError as err:
            # A rung the planner refuses still gets its measured row; the reason is shown, not hidden.
            log.warning("planner could not predict rung %s: %s", rung, err)
        rows.append(row)
    return rows


def _fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v / scale:,.{digits}g}" if isinstance(v, (int, float)) else str(v)


def _err(measured: Any, predicted: Any) -> str:
    if not measured or predicted is None:
        return "-"
    return f"{predicted / measured - 1:+.1%}"


def write_ladder_report(rows: list[LadderRow], out_dir: Path) -> dict[str, Path]:
    """Write ``ladder.csv``, ``ladder.md`` and ``ladder.png`` into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "ladder.csv", "md": out_dir / "ladder.md", "png": out_dir / "ladder.png"}
    fields = list(LadderRow.__dataclass_fields__)
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    head = (
        "| # | rung | status | peak GiB (pred) | err | model states GiB (pred) | err | activations GiB (pred) | err "
        "| tok/s/dev (pred) | TFLOP/s/dev | MFU | $/1B tok (pred) |"
    )
    lines = [
        "# Optimization ladder",
        "",
        "Measured on rank 0 per device; (pred) = `plan(cfg)` for the same config.",
        "",
        head,
        "|" + "---|" * 13,
    ]
    for r in rows:
        peak = f"{_fmt(r.peak_memory_bytes, _GIB)} ({_fmt(r.predicted_peak_bytes, _GIB)})"
        states = f"{_fmt(r.model_states_bytes, _GIB)} ({_fmt(r.predicted_model_states_bytes, _GIB)})"
        cells = [
            str(r.job),
            r.rung,
            status_text(r.status, r.stopped_by, r.stopped_at_step),
            peak,
            _err(r.peak_memory_bytes, r.predicted_peak_bytes),
            states,
            _err(r.model_states_bytes, r.predicted_model_states_bytes),
            f"{_fmt(r.activations_bytes, _GIB)} ({_fmt(r.predicted_activations_bytes, _GIB)})",
            _err(r.activations_bytes, r.predicted_activations_bytes),
            f"{_fmt(r.tokens_per_sec)} ({_fmt(r.predicted_tokens_per_sec)})",
            _fmt(r.tflops_per_device),
            _fmt(r.mfu),
            f"{_fmt(r.usd_per_1b_tokens)} ({_fmt(r.predicted_usd_per_1b_tokens)})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    # Only `ok` trained as configured; the figures of a stopped, diverged or OOM rung are no result to compare.
    failed = [f"{r.rung} ({status_text(r.status, r.stopped_by, r.stopped_at_step)})" for r in rows if r.status != "ok"]
    if failed:
        lines += ["", f"Not a success: {', '.join(failed)}."]
    paths["md"].write_text("\n".join(lines) + "\n")
    _plot(rows, paths["png"])
    return paths


def _plot(rows: list[LadderRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.rung if r.status == "ok" else f"{r.rung} ({r.status.upper()})" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.4
    ax1.bar([i - w / 2 for i in x], [(r.peak_memory_bytes or 0) / _GIB for r in rows], w, label="measured peak")
    ax1.bar([i + w / 2 for i in x], [(r.predicted_peak_bytes or 0) / _GIB for r in rows], w, label="planner")
    ax1.set_ylabel("GiB per device")
    ax1.set_title("memory per device")
    ax2.bar([i - w / 2 for i in x], [r.tokens_per_sec or 0 for r in rows], w, label="measured")
    ax2.bar([i + w / 2 for i in x], [r.predicted_tokens_per_sec or 0 for r in rows], w, label="planner")
    ax2.set_ylabel("tokens/s per device")
    ax2.set_title("throughput per device")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class LadderReport(Callback):
    """Hydra callback writing the ladder report at the end of the multirun (rank 0 of the launching process).

    Example (in an experiment file)::

        hydra:
          callbacks:
            ladder_report:
              _target_: lightning_trainopt.app.ladder.LadderReport
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) or int(os.environ.get("NODE_RANK", "0")):
            return  # a DDP child re-running the command: the launching process writes the report
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        try:
            rows = collect_ladder(sweep_dir)
            paths = write_ladder_report(rows, sweep_dir)
        except Exception as err:
            # Hydra turns a callback's exception into a warning and exits 0; a ladder without its report is a
            # failed run. SystemExit is not an Exception, so it passes Hydra's handler and sets the exit status.
            log.exception("the ladder report could not be written")
            raise SystemExit(f"error: ladder report not written ({type(err).__name__}: {err})") from err
        print(paths["md"].read_text())
        print(f"ladder report: {paths['md']}, {paths['csv']}, {paths['png']}")
