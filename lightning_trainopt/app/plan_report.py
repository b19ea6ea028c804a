"""The planner's one-screen derivation (rich), so a user can check every figure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from lightning_trainopt.app.plan import PlanResult

__all__ = ["print_plan"]

_GIB = 2**30


def _g(n: int | float | None) -> str:
    return "-" if not n else f"{n / _GIB:,.2f}"


def _human(n: float | None, unit: str = "", digits: int = 3) -> str:
    return "-" if n is None else f"{n:,.{digits}g}{unit}"


def print_plan(result: PlanResult, top_k: int = 10, console: Console | None = None) -> None:
    """Print the derivation of ``result`` (and the search ranking when there is one)."""
    console = console or Console(width=None if Console().is_terminal else 150)
    e, i, hw = result.estimate, result.estimate.inputs, result.hardware
    n = i.model.n_params()
    ch = result.choices
    console.rule(f"[bold]plan: {i.model.name} ({n / 1e9:.3f}B params) on {i.world_size} x {hw.name}")
    console.print(
        f"precision {i.trainer_precision} | strategy {i.layout.name} ({i.layout.kind}"
        f"{', ZeRO-' + str(i.layout.zero_stage) if i.layout.zero_stage else ''}) | activations "
        f"{ch.get('activations', i.activations.name)} | optimizer {i.optimizer.name} | micro-batch {i.micro_batch} x "
        f"{i.seq_len} tokens x accumulate {i.accumulate}"
    )
    table = Table(title="per-device memory (GiB = 2^30 B)", show_lines=False)
    for col in ("category", "term", "formula", "phase", "device", "cpu", "nvme"):
        table.add_column(col, justify="right" if col in ("device", "cpu", "nvme") else "left")
    for t in e.memory.terms:
        cells = {loc: _g(t.nbytes) if t.location == loc else "" for loc in ("device", "cpu", "nvme")}
        table.add_row(t.category, t.label, t.formula, t.phase, cells["device"], cells["cpu"], cells["nvme"])
    totals = e.memory.per_device()
    table.add_row(
        "total",
        "all terms at once (conservative)",
        "",
        "",
        _g(totals["total"]),
        _g(e.memory.bytes(location="cpu")),
        _g(e.memory.bytes(location="nvme")),
    )
    table.add_row(
        "[bold]peak", "'all' + max(backward, step + in_step)", "", "", f"[bold]{_g(e.peak_device_bytes)}", "", ""
    )
    console.print(table)
    if e.fits is None or e.device_memory_bytes is None:
        console.print("device memory unknown for this hardware: set hardware.memory_gb to get a verdict.")
    else:
        verdict = "[green]fits" if e.fits else "[red]does NOT fit"
        usable = e.device_memory_bytes - e.headroom_bytes
        head = f"{_g(usable)} GiB usable ({_g(e.device_memory_bytes)} GiB less {_g(e.headroom_bytes)} GiB headroom)"
        console.print(
            f"{verdict}[/]: peak {_g(e.peak_device_bytes)} of {head}, margin {_g(e.margin_bytes)} GiB"
            if e.fits
            else f"{verdict}[/]: peak {_g(e.peak_device_bytes)} GiB of {head}"
        )
    tb = result.textbook
    console.print(
        f"textbook check (ZeRO paper): fp32 Adam 4+4+8 = 16 B/param -> {tb['fp32']['total'] / 1e9:,.1f} GB; "
        f"mixed AdamW 2+2+12 = 16 B/param -> {tb['mixed']['total'] / 1e9:,.1f} GB "
        f"(not {20 * n / 1e9:,.0f} GB from optimizer states at 16 B, nor {8 * n / 1e9:,.0f} GB from 16-bit moments). "
        "Above: what the chosen implementation really allocates per device."
    )
    s = e.speed
    console.print(
        f"speed: {_human(e.train_flops_per_token)} FLOP/token executed; {s.source}\n"
        f"  -> {_human(s.tokens_per_sec_per_device, ' tok/s')} per device, step {_human(s.step_time_s, ' s')}, "
        f"${_human(s.usd_per_1b_tokens)} per 1B tokens; target: {_human(s.hours_to_target, ' h')}, "
        f"${_human(s.usd_to_target)} (price x devices x hours; {hw.sources.get('price', '')})"
    )
    if result.n_enumerated:
        _print_search(result, top_k, console)
    elif result.command:
        console.print(f"run it: [bold]{result.command}")


def _print_search(result: PlanResult, top_k: int, console: Console) -> None:
    table = Table(title=f"search: {len(result.candidates)} of {result.n_enumerated} configurations fit; top {top_k}")
    for col in (
        "#",
        "precision",
        "strategy",
        "activations",
        "optimizer",
        "mb x acc",
        "peak GiB/dev",
        "tok/s/dev",
        "$/1B tok",
        "speed",
        "why",
    ):
        table.add_column(col)
    for k, c in enumerate(result.candidates[:top_k], 1):
        e = c.estimate
        table.add_row(
            str(k),
            c.choices["precision"],
            c.choices["strategy"],
            c.choices["activations"],
            c.choices["optimizer"],
            f"{e.inputs.micro_batch} x {e.inputs.accumulate}",
            _g(e.peak_device_bytes),
            _human(e.speed.tokens_per_sec_per_device, "", 4),
            _human(e.speed.usd_per_1b_tokens, "", 4),
            "measured" if e.speed.source.startswith("measured") else "FLOPs x MFU",
            c.reason,
        )
    console.print(table)
    if result.command:
        console.print(f"winner: [bold]{result.command}")
    else:
        console.print("[red]no configuration fits: add devices, shorten data.seq_len, or choose a smaller model.")
