"""The end-of-run summary: one rich table a person reads at a glance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["format_bytes", "print_summary", "summary_rows"]

_HEADLINE = (
    ("status", "status"),
    ("model", "model"),
    ("n_params", "parameters"),
    ("strategy", "strategy"),
    ("zero_stage", "ZeRO stage (engine)"),
    ("precision", "precision"),
    ("world_size", "world size"),
    ("global_batch_size", "global batch (sequences)"),
    ("global_step", "optimizer steps"),
    ("train_loss", "final train loss"),
    ("val_loss", "val loss"),
    ("tokens_seen", "tokens seen"),
    ("tokens_per_sec", "tokens/s (all ranks)"),
    ("wall_seconds", "wall time (s)"),
)


# Keys of memory sections whose figures are bytes.
_BYTE_KEYS = {"params", "grads", "optimizer_states", "activations", "other", "device", "cpu", "nvme", "total"}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if (key.endswith("bytes") or key in _BYTE_KEYS) and isinstance(value, (int, float)):
        return format_bytes(value)
    if isinstance(value, float):
        if abs(value) < 1e-12:
            return "0"  # rounding residue such as 1 - sum(fractions)
        if abs(value) < 0.01:
            return f"{value:.3g}"  # learning rates, dollars per token: 6e-05, not 0.0001
        return f"{value:,.4f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _section(value: dict[str, Any]) -> str:
    """One compact cell for a callback's section: its non-empty scalar figures, nested ones dotted."""
    parts: list[str] = []
    for key, v in value.items():
        if isinstance(v, dict):
            parts.extend(
                f"{key}.{k2} {_fmt(key if key in _BYTE_KEYS else k2, v2)}"
                for k2, v2 in v.items()
                if v2 is not None and not isinstance(v2, (dict, list))
            )
        elif v is not None and not isinstance(v, list):
            parts.append(f"{key} {_fmt(key, v)}")
    return ", ".join(parts)


def summary_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows: the headline figures, then one row per section that a callback added."""
    rows = [(label, _fmt(key, metrics[key])) for key, label in _HEADLINE if key in metrics]
    shown = {key for key, _ in _HEADLINE} | {"trainer_precision", "tokens_this_run", "train_seconds", "devices"}
    for key, value in metrics.items():
        if key in shown or isinstance(value, list):
            continue
        if isinstance(value, dict):
            cell = _section(value)
            if cell:
                rows.append((key, cell))
        else:
            rows.append((key, _fmt(key, value)))
    return rows


def print_summary(metrics: dict[str, Any], metrics_path: Path | None = None, console: Console | None = None) -> None:
    table = Table(title="lightning_trainopt run summary", show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", overflow="fold")
    for label, value in summary_rows(metrics):
        table.add_row(label, value)
    console = console or Console()
    console.print(table)
    if metrics_path is not None:
        console.print(f"all figures: {metrics_path}", soft_wrap=True)
