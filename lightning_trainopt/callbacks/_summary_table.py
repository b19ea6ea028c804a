"""The end-of-run summary: one rich table a person reads at a glance (train.py's and :class:`FitReport`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["callback_summaries", "format_bytes", "print_summary", "summary_rows"]

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
    ("final_validation", "final validation"),
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


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _join(*parts: str | None) -> str:
    return " · ".join(p for p in parts if p)


def _memory(m: dict[str, Any]) -> str:
    def states(name: str, label: str) -> str:
        v = m.get(name)
        if not isinstance(v, dict):
            return f"{label} {_fmt('bytes', v)}" if v is not None else ""
        away = [f"{format_bytes(v[k])} {k}" for k in ("cpu", "nvme") if v.get(k)]
        return f"{label} {format_bytes(v.get('device') or 0)}" + (f" (+{', '.join(away)})" if away else "")

    copies = m.get("activations_weight_copies")
    acts = f"activations {_fmt('bytes', m.get('activations'))}" + (
        f" (weight copies {format_bytes(copies)})" if copies else ""
    )
    peak = m.get("peak_memory_bytes")
    return _join(
        states("params", "params"),
        states("grads", "grads"),
        states("optimizer_states", "optimizer"),
        acts,
        f"other {format_bytes(m['other'])}" if m.get("other") is not None else None,
        f"peak {format_bytes(peak)}" if peak is not None else None,
        f"at step {m['step']}" if "step" in m else None,
    )


def _step_time(t: dict[str, Any]) -> str:
    split = [
        (label, t.get(key))
        for key, label in (
            ("data_wait_frac", "data"),
            ("h2d_frac", "h2d"),
            ("forward_frac", "fwd"),
            ("backward_frac", "bwd"),
            ("optimizer_frac", "optim"),
            ("comm_frac", "comm"),
            ("other_frac", "other"),
        )
        if t.get(key) is not None
    ]
    verdict = t.get("verdict")
    head = f"{verdict} ({t['reason']})" if verdict and t.get("reason") else verdict
    step = f"{t['step_s']:.3g} s/step" if t.get("step_s") else None
    return _join(head, " ".join(f"{label} {_pct(v)}" for label, v in split) or None, step)


def _throughput(t: dict[str, Any]) -> str:
    per, total = t.get("tokens_per_s"), t.get("tokens_per_s_total")
    tokens = f"{_fmt('', per)} tokens/s per device" + (f" ({_fmt('', total)} all)" if total not in (None, per) else "")
    mfu = (
        f"MFU {_pct(t.get('mfu'))} · HFU {_pct(t.get('hfu'))}"
        if t.get("mfu") is not None
        else f"MFU - (no peak for {t.get('dtype')} on {t.get('hardware')})"
    )
    return _join(
        tokens if per is not None else None,
        f"{t['tflops_per_s']:.3g} TFLOP/s" if t.get("tflops_per_s") is not None else None,
        mfu,
        "warm-up excluded",
        t.get("flops_note"),
    )


def _cost(c: dict[str, Any]) -> str:
    def dollars(v: Any) -> str | None:
        return None if v is None else f"${v:,.2f}"

    spent = dollars(c.get("dollars"))
    left = c.get("projected_seconds_left")
    return _join(
        f"{spent} spent" if spent else "no price (set hardware.price_per_device_hour)",
        f"{_fmt('', c.get('device_hours'))} device-hours" if c.get("device_hours") is not None else None,
        f"{dollars(c['dollars_per_1b_tokens'])}/1B tokens" if c.get("dollars_per_1b_tokens") is not None else None,
        f"projected {dollars(c['projected_total_dollars'])}" if c.get("projected_total_dollars") is not None else None,
        f"{left / 3600:.2f} h left" if left else None,
        f"{dollars(c['dollars_lost_idle'])} idle" if c.get("dollars_lost_idle") else None,
    )


def _gpu(g: dict[str, Any]) -> str:
    if not g.get("enabled"):
        return "off (no NVML/GPU)"
    return _join(
        f"utilisation {g['util_pct_mean']:.0f}%" if g.get("util_pct_mean") is not None else None,
        "below target" if g.get("low_util_warning") else None,
    )


def _snapshot(s: dict[str, Any]) -> str:
    if not s.get("enabled"):
        return "off (CUDA only)"
    files = s.get("files") or []
    return _join(
        f"{len(files)} file(s): {', '.join(map(str, files[:2]))}" if files else "no file yet", s.get("oom") and "OOM"
    )


def _checkpointing(a: dict[str, Any]) -> str:
    own = a.get("self_checkpointed")
    if own:
        return f"left to the model (it checkpoints itself: {', '.join(own[:2])})"
    return f"{a.get('wrapped')} of {a.get('candidates')} modules (every {a.get('every_k')})"


def _non_finite(n: dict[str, Any]) -> str:
    norm = n.get("last_grad_norm")
    return _join(
        f"skipped {n.get('skipped_steps', 0)}",
        f"fp16 overflows {n['overflow_steps']}" if n.get("overflow_steps") else None,
        f"last grad norm {norm:.3g}" if isinstance(norm, (int, float)) else None,
    )


def _precision_layers(p: dict[str, Any]) -> str:
    fp32 = f"{p['fp32_modules']} modules in fp32" if p.get("fp32_modules") else None
    if p.get("backend") is None:
        return _join(fp32)
    how = f"{p['backend']} {p['recipe']}" + (", emulated" if p.get("emulated") else "")
    if p.get("warning"):
        # An FP8 run that converted nothing trains without FP8: say it first, with the causes and their settings.
        return _join(f"FP8 ({how}): {p['warning']}", fp32)
    left_out = [
        f"{e['layers']} {e['why']}" + (f" (change: {e['change']})" if e.get("change") else "")
        for e in p.get("not_fp8") or []
    ]
    return _join(
        f"FP8 ({how}): {p['fp8_layers']} linear layers ({_pct(p.get('fp8_weight_fraction'))} of their weights)",
        *(f"not FP8: {part}" for part in left_out),
        fp32,
    )


# Sections the project's callbacks add, each shown as one curated line (label, formatter); anything else a
# callback adds is shown generically. Every figure stays in metrics.json.
_SECTIONS: dict[str, tuple[str, Any]] = {
    "throughput": ("throughput", _throughput),
    "step_time": ("step time", _step_time),
    "memory_breakdown": ("memory per rank", _memory),
    "cost": ("cost", _cost),
    "gpu": ("GPU", _gpu),
    "memory_snapshot": ("memory snapshot", _snapshot),
    "activation_checkpointing": ("checkpointing", _checkpointing),
    "non_finite": ("non-finite guard", _non_finite),
    "precision_layers": ("precision layers", _precision_layers),
}
_HIDDEN = {
    "trainer_precision",
    "tokens_this_run",
    "train_seconds",
    "devices",
    "accelerator",
    "peak_memory_bytes",  # inside the memory line
}


def summary_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows: the headline figures, then one row per section that a callback added.

    The project's own sections get one curated line each (the figures a person acts on); other sections show
    their scalar figures. ``None`` top-level figures are left out; metrics.json keeps everything.
    """
    rows = [(label, _fmt(key, metrics[key])) for key, label in _HEADLINE if key in metrics]
    shown = {key for key, _ in _HEADLINE} | _HIDDEN
    for key, value in metrics.items():
        if key in shown or isinstance(value, list) or value is None:
            continue
        if isinstance(value, dict) and key in _SECTIONS:
            label, formatter = _SECTIONS[key]
            cell = formatter(value)
            if cell:
                rows.append((label, cell))
        elif isinstance(value, dict):
            cell = _section(value)
            if cell:
                rows.append((key, cell))
        else:
            rows.append((key, _fmt(key, value)))
    return rows


def callback_summaries(callbacks: list[Any]) -> dict[str, Any]:
    """Merge every callback's ``summary()``; a section several callbacks fill (``memory_breakdown``) merges by key."""
    out: dict[str, Any] = {}
    for cb in callbacks:
        summary = getattr(cb, "summary", None)
        if not callable(summary):
            continue
        for key, value in summary().items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            elif value is not None or key not in out:
                out[key] = value
    return out


def print_summary(metrics: dict[str, Any], metrics_path: Path | None = None, console: Console | None = None) -> None:
    """Print the summary table of ``metrics`` (a metrics.json dict), and where the full figures are."""
    table = Table(title="lightning_trainopt run summary", show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", overflow="fold")
    for label, value in summary_rows(metrics):
        # Values are plain text: a "[...]" in one (a list, a glob) is not rich markup.
        table.add_row(label, escape(value))
    console = console or Console()
    console.print(table)
    if metrics_path is not None:
        console.print(f"all figures: {metrics_path}", soft_wrap=True)
