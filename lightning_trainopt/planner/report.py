"""The planner's one-screen derivation (rich), so a user can check every figure; which jobs of a plan sweep failed.

Pure: what it needs of the composed config (preset names, overrides) is read in ``config/plan_command.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lightning_trainopt.metrics.hardware import compute_dtype_key
from lightning_trainopt.planner.result import model_flops_per_token
from lightning_trainopt.planner.teacher import adapter_teacher_lines

if TYPE_CHECKING:
    from lightning_trainopt.metrics.hardware import HardwareSpec
    from lightning_trainopt.planner import PlanEstimate, PlanInputs
    from lightning_trainopt.planner.result import PlanResult

__all__ = [
    "model_flops_per_token",
    "print_plan",
    "refused_jobs",
    "seq_len_note",
]

_GIB = 2**30


# A planned length below this share of the model's context, taken from the data preset, gets a note.
_SHORT_SEQ_SHARE = 4


def seq_len_note(inputs: PlanInputs, default_of: str) -> str:
    """What to do when the planned ``seq_len`` is a data preset's default far below the model's ``max_seq_len``.

    Args:
        inputs: the planned values.
        default_of: the data preset whose default ``seq_len`` is planned; ``""`` when the user set it.

    Returns:
        one sentence naming the length, where it comes from and the override to plan another; ``""`` when the
        length was set or is at least a quarter of ``max_seq_len``.
    """
    m = inputs.profile
    if not default_of or m.max_seq_len is None or inputs.seq_len * _SHORT_SEQ_SHARE >= m.max_seq_len:
        return ""
    # Our presets say it in model.max_seq_len; a Hugging Face config in max_position_embeddings, a module as it may.
    where = "its longest sequence" if m.measured else "model.max_seq_len"
    return (
        f"seq_len {inputs.seq_len} is the default of data={default_of}, not a length you set: {m.name} takes up to "
        f"{m.max_seq_len} tokens ({where}), and activation memory and attention FLOPs grow with the "
        f"length. To plan the length you will train at, add data.seq_len=<tokens>, e.g. data.seq_len={m.max_seq_len}."
    )


def _g(n: int | float | None) -> str:
    return "-" if not n else f"{n / _GIB:,.2f}"


def _human(n: float | None, unit: str = "", digits: int = 3) -> str:
    return "-" if n is None else f"{n:,.{digits}g}{unit}"


def print_plan(result: PlanResult, top_k: int | None = None, console: Console | None = None) -> None:
    """Print the derivation of ``result`` (and the search ranking when there is one).

    Args:
        result: what :func:`~lightning_trainopt.config.plan.plan` returned.
        top_k: rows of the search ranking (default ``result.top_k``, i.e. ``plan.top_k``).
        console: where to print (default: stdout).
    """
    top_k = result.top_k if top_k is None else top_k
    console = console or Console(width=None if Console().is_terminal else 150)
    e, i, hw = result.estimate, result.estimate.inputs, result.hardware
    n = i.profile.n_params
    ch = result.choices
    default = f" (data={result.seq_len_default_of} default)" if result.seq_len_default_of else ""
    console.rule(
        f"[bold]plan: {i.profile.name} ({n / 1e9:.3f}B params) at seq_len {i.seq_len}{default} on "
        f"{i.world_size} x {hw.name}"
    )
    if result.seq_len_note:
        console.print(f"[yellow]note:[/] {result.seq_len_note}")
    console.print(
        f"precision {i.trainer_precision} | strategy {i.layout.name} ({i.layout.label}) | activations "
        f"{ch.get('activations', i.activations.name)} | optimizer {i.optimizer.name} | micro-batch {i.micro_batch} x "
        f"{i.seq_len} tokens x accumulate {i.accumulate}"
    )
    changes = _precision_line(e)
    if changes:
        console.print(changes)
    for line in adapter_teacher_lines(i):
        console.print(escape(line))
    dims = parallel_line(e)
    if dims:
        console.print(escape(dims))
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
    if e.device_fits is None or e.device_memory_bytes is None:
        console.print("device memory unknown for this hardware: set hardware.memory_gb to get a verdict.")
    else:
        verdict = "[green]fits" if e.device_fits else "[red]does NOT fit"
        usable = e.device_memory_bytes - e.headroom_bytes
        head = f"{_g(usable)} GiB usable ({_g(e.device_memory_bytes)} GiB less {_g(e.headroom_bytes)} GiB headroom)"
        console.print(
            f"{verdict}[/]: peak {_g(e.peak_device_bytes)} of {head}, margin {_g(e.margin_bytes)} GiB"
            if e.device_fits
            else f"{verdict}[/]: peak {_g(e.peak_device_bytes)} GiB of {head}"
        )
    _print_host(e, hw, console)
    tb = result.textbook
    console.print(
        f"textbook check (ZeRO paper): fp32 Adam 4+4+8 = 16 B/param -> {tb['fp32']['total'] / 1e9:,.1f} GB; "
        f"mixed AdamW 2+2+12 = 16 B/param -> {tb['mixed']['total'] / 1e9:,.1f} GB "
        f"(not {20 * n / 1e9:,.0f} GB from optimizer states at 16 B, nor {8 * n / 1e9:,.0f} GB from 16-bit moments). "
        "Above: what the chosen implementation really allocates per device."
    )
    s = e.speed
    console.print(
        f"speed: {_flops_line(e)}; {_speed_source(result)}\n"
        f"{_step_line(e, hw)}"
        f"  -> {_human(s.tokens_per_sec_per_device, ' tok/s')} per device, step {_human(s.step_time_s, ' s')}"
        f"{_implied_mfu(e)}, ${_human(s.usd_per_1b_tokens)} per 1B tokens; target: {_human(s.hours_to_target, ' h')}, "
        f"${_human(s.usd_to_target)} (price x devices x hours; {hw.sources.get('price', '')})"
    )
    if result.n_enumerated:
        _print_search(result, top_k, console)
    elif result.next_step:
        # A plan that does not fit is an answer, not an error (exit code 0): say what to run instead.
        console.print(f"[red]next step:[/] {escape(result.next_step)}")
    elif result.command:
        console.print(f"run it: [bold]{escape(result.command)}")


def _precision_line(e: PlanEstimate) -> str:
    """What the precision preset and the loss change, in words (empty when nothing)."""
    i, p = e.inputs, e.inputs.precision
    parts = []
    if p is not None and p.backend is not None:
        how = f"{p.backend} {p.recipe}" + (", emulated in fp32 (no FP8 speed-up)" if p.emulated else "")
        share = p.fp8_weight_fraction
        parts.append(
            f"FP8 ({how}): {len(p.fp8_shapes)} of {len(p.linear_shapes)} linear layers converted"
            + (f" ({share:.0%} of their weights)" if share is not None else "")
            + f", {e.speed.fp8_flops_share:.0%} of the model FLOPs"
        )
    if p is not None and p.fp32_modules:
        shown = ", ".join(p.fp32_modules[:4]) + (
            f" and {len(p.fp32_modules) - 4} more" if len(p.fp32_modules) > 4 else ""
        )
        parts.append(f"kept in fp32: {shown}")
    if p is not None:
        parts.append(
            "activations measured on fake tensors under the conversion"
            if p.measure is not None
            else "Transformer Engine's saved bytes derived per converted layer"
        )
    if i.loss is not None and i.loss.kind != "standard":
        parts.append(f"loss {i.loss.name}: no logits kept")
    return escape("; ".join(parts))


def _flops_line(e: PlanEstimate) -> str:
    """Model FLOPs per token and, when checkpointing replays part of the forward, what the hardware executes."""
    model = model_flops_per_token(e.inputs)
    recompute = e.train_flops_per_token - model
    if recompute <= 0:
        return f"{model:#.3g} FLOP/token (forward + backward; nothing recomputed)"
    return (
        f"{model:#.3g} model FLOP/token (forward + backward) + {recompute:#.3g} recomputed by activation "
        f"checkpointing = {e.train_flops_per_token:#.3g} FLOP/token executed"
    )


def _speed_source(result: PlanResult) -> str:
    """Where the tokens/s come from: the executed FLOPs at ``plan.hfu`` of the peak, a measured run, or nowhere."""
    s, hw, i = result.estimate.speed, result.hardware, result.estimate.inputs
    if s.source.startswith("measured") or s.tokens_per_sec_per_device is None:
        return s.source
    dtype = compute_dtype_key(i.trainer_precision, hw.name != "cpu")
    peak = hw.peak(dtype) or 0.0
    out = (
        f"compute at {result.hfu:.0%} (plan.hfu, of the FLOPs executed) of the {peak / 1e12:g} TFLOP/s dense {dtype} "
        "peak"
    )
    if s.fp8_flops_share and s.fp8_peak_flops:
        out += f", the FP8 layers' {s.fp8_flops_share:.0%} at the {s.fp8_peak_flops / 1e12:g} TFLOP/s dense fp8 peak"
    elif s.fp8_flops_share:
        why = "emulated in fp32 on a CPU" if i.precision is not None and i.precision.emulated else "no fp8 peak here"
        out += f", the FP8 layers' {s.fp8_flops_share:.0%} too ({why}: no FP8 speed-up assumed)"
    return out


# The hardware figure each overhead item is charged with: (source key, how to print the rate).
_RATE_OF = {
    "activation offload": "pcie",
    "updated parameters to the device": "pcie",
    "PCIe device -> host": "pcie",
    "PCIe host -> device": "pcie",
    "int8 activation compression": "memory_bandwidth",
    "CPU Adam": "cpu_adam",
    "CPU AdamW (fused)": "cpu_adam",
    "NVMe swaps": "nvme",
}


def _rate(hw: HardwareSpec, key: str) -> str:
    figure = {
        "pcie": (hw.pcie_bytes_per_s, "PCIe", 1e9, "GB/s each way"),
        "memory_bandwidth": (hw.memory_bytes_per_s, "device memory", 1e9, "GB/s"),
        "nvme": (hw.nvme_bytes_per_s, "NVMe", 1e9, "GB/s per node"),
        "cpu_adam": (hw.cpu_adam_params_per_s, "CPU Adam", 1.0, "params/s per node"),
    }[key]
    value, name, unit, text = figure
    return f"{name} {(value or 0) / unit:,.3g} {text} ({hw.sources.get(key, '')})"


def _step_line(e: PlanEstimate, hw: HardwareSpec) -> str:
    """The step time's parts when offload or compression is charged (or could not be), one line each, and the rates
    they were charged at with their sources; ``""`` when there is none."""
    s = e.speed
    o = s.overhead
    if o is None or s.compute_s is None or not (o.overlapped or o.serial or o.not_charged):
        return ""
    lines = [
        f"  step = max(compute {s.compute_s:.3g} s, copies and collectives beside compute {o.overlapped_s:.3g} s) "
        f"+ waits {o.serial_s:.3g} s = {s.step_time_s:.3g} s"
    ]
    for name, seconds in o.overlapped.items():
        lines.append(f"    beside compute, {name}: {seconds:.3g} s = {o.formulas.get(name, '')}")
    for name, seconds in o.serial.items():
        lines.append(f"    wait, {name}: {seconds:.3g} s = {o.formulas.get(name, '')}")
    lines += [f"    not charged: {what}" for what in o.not_charged]
    used = dict.fromkeys(_RATE_OF[n] for n in [*o.overlapped, *o.serial] if n in _RATE_OF)
    lines += [f"    at {_rate(hw, key)}" for key in used]
    return escape("\n".join(lines)) + "\n"


def _implied_mfu(e: PlanEstimate) -> str:
    """`` (model FLOPs utilisation 35.0%)``: what the predicted tokens/s imply (empty when unknown)."""
    mfu = e.speed.mfu(model_flops_per_token(e.inputs))
    return "" if mfu is None else f" (model FLOPs utilisation {mfu:.1%})"


def _print_host(e: PlanEstimate, hw: HardwareSpec, console: Console) -> None:
    """The host-RAM verdict of a configuration that offloads to CPU (nothing when nothing is offloaded)."""
    per_node = e.host_bytes_per_node
    if not per_node:
        return
    ranks = e.inputs.devices
    what = "in RAM (the CPU is the device)" if e.device_is_host else "offloaded"
    used = f"{_g(per_node)} GiB {what} per node ({_g(per_node // ranks)} GiB x {ranks} rank{'s' * (ranks > 1)})"
    if e.host_fits is None:
        console.print(f"host RAM: {used}; RAM of a node unknown: set hardware.host_memory_gb to get a verdict.")
        return
    verdict = "[green]fits" if e.host_fits else "[red]does NOT fit"
    usable = e.host_usable_bytes or 0
    console.print(
        f"host RAM {verdict}[/]: {used} of {_g(usable)} GiB usable ({_g(e.host_memory_bytes or 0)} GiB less "
        f"{e.headroom_fraction:.0%} for the processes; {hw.sources.get('host_memory', '')})"
    )


def _print_search(result: PlanResult, top_k: int, console: Console) -> None:
    n_fit = len(result.candidates)
    with_loss = any("loss" in c.choices for c in result.candidates)
    table = Table(
        title=f"search: {n_fit} configuration{'s' * (n_fit != 1)} fit ({result.n_enumerated} estimates of precision x "
        f"strategy x activations x optimizer{' x loss' if with_loss else ''} x micro-batch); top {min(top_k, n_fit)}, "
        "each at its best micro-batch"
    )
    for col in (
        "#",
        "precision",
        "strategy",
        "activations",
        "optimizer",
        *(("loss",) if with_loss else ()),
        "TP",
        "SP",
        "HSDP",
        "mb x acc",
        "peak GiB/dev",
        "margin GiB",
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
            *((c.choices.get("loss", ""),) if with_loss else ()),
            *_dims_cells(e),
            f"{e.inputs.micro_batch} x {e.inputs.accumulate}",
            _g(e.peak_device_bytes),
            "-" if e.margin_bytes is None else f"{e.margin_bytes / _GIB:,.2f}",
            _human(e.speed.tokens_per_sec_per_device, "", 4),
            _human(e.speed.usd_per_1b_tokens, "", 4),
            _speed_kind(e),
            c.reason,
        )
    console.print(table)
    if result.parallelism:
        console.print(f"parallelism: {escape(result.parallelism)}")
    if result.command:
        console.print(f"winner: [bold]{escape(result.command)}")
    else:
        i = result.estimate.inputs
        console.print(
            f"[red]no configuration fits on {i.world_size} x {result.hardware.name}:[/] search more devices "
            f"(trainer.devices={2 * i.devices} plan.search=true), shorten data.seq_len, or choose a smaller model."
        )


def _dims_cells(e: PlanEstimate) -> tuple[str, str, str]:
    """The TP, SP and HSDP cells of a row: TP size, sequence parallelism, replicas x shards (``-``: none)."""
    i = e.inputs
    tp = str(i.tensor_parallel)
    sp = ("yes" if i.sequence_parallel else "no") if i.tensor_parallel > 1 else "-"
    hsdp = f"{i.replicate} x {i.shard_size}" if i.replicate > 1 else "-"
    return tp, sp, hsdp


def parallel_line(e: PlanEstimate) -> str:
    """One line on the parallel layout of a plan with TP or HSDP (``""`` without): the mesh and the TP collectives."""
    i = e.inputs
    if i.tensor_parallel == 1 and i.replicate == 1:
        return ""
    tp, sp, hsdp = _dims_cells(e)
    line = f"parallel: TP {tp} (sequence parallel: {sp}) x data parallel {i.data_parallel_size}"
    if i.replicate > 1:
        line += f" (HSDP {hsdp}: FSDP2 shards within each replica group)"
    o = e.speed.overhead
    for item, seconds in o.serial.items() if o is not None else ():
        if item.startswith("TP collectives"):
            line += f"; {item}: {seconds:.3g} s/step (in the step time below)"
    for item in o.not_charged if o is not None else ():
        if item.startswith("TP collectives"):
            line += f"; {item}"
    return line


def _speed_kind(e: PlanEstimate) -> str:
    """The search table's ``speed`` cell: measured, or the FLOPs model and whether offload or int8 time was added."""
    s = e.speed
    if s.source.startswith("measured"):
        return "measured"
    if s.step_time_s is not None and s.compute_s is not None and s.step_time_s > s.compute_s:
        return "FLOPs x HFU + offload/int8"
    return "FLOPs x HFU"


def refused_jobs(sweep_dir: Path) -> dict[str, str]:
    """``{job: error}`` of the jobs of a ``plan.py -m`` sweep that were not planned: refused, or failed (raised).

    Such a job leaves ``metrics.json`` with ``status: refused`` or ``failed`` in its directory (``launch.cli``); a
    planned one leaves nothing there (the plan goes to stdout).
    """
    out = {}
    for metrics in sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        data = json.loads(metrics.read_text())
        if isinstance(data, dict) and data.get("status") in ("refused", "failed"):
            out[metrics.parent.name] = f"{data['status']}: {data.get('error', '')}"
    return out
