"""The rows of the ladder report: each job's metrics.json beside ``plan(cfg)`` for the same config.

:func:`collect_ladder` reads the job directories of a ``python train.py -m experiment=ladder`` sweep;
:func:`predicted_row` turns a plan into a row (the planner's half, or a whole predicted row when nothing was run).
The report itself (``ladder.md``, ``ladder.csv``, ``ladder.png``) is written by
:mod:`lightning_trainopt.experiments.ladder`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.exceptions import TrainOptError

if TYPE_CHECKING:
    from lightning_trainopt.config.plan import PlanResult

__all__ = ["CALIBRATION", "PREDICTED", "LadderRow", "collect_ladder", "ladder_rungs", "predicted_row"]

log = logging.getLogger(__name__)

RUNG_KEY = "experiment/ladder_rung"
#: ``status`` of a row of the planner alone (nothing was run).
PREDICTED = "predicted"
#: ``speed_source`` prefix of the rung whose measured FLOP/s calibrates its dtype's predictions.
CALIBRATION = "calibration"


@dataclass
class LadderRow:
    """One rung: what was measured and what the planner predicted for the same config.

    Args:
        job: Hydra job number.
        rung: the rung's name (``conf/experiment/ladder_rung/<rung>.yaml``).
        status: metrics.json's: ``ok`` (the only success), ``stopped`` (a callback ended the fit early),
            ``diverged`` (the final train loss is not finite), ``oom``, ``refused``; ``failed`` without metrics.json;
            ``predicted`` for a row of the planner alone (nothing was run).
        predicted_fits: the planner's verdict (``None``: the device memory is unknown).
        predicted_margin_bytes: device memory left at the predicted peak (negative: does not fit).
        peak_memory_bytes: measured peak per device (the allocator's; ``None`` on CPU).
        predicted_peak_bytes: the planner's per-device peak.
        model_states_bytes: measured params + grads + optimizer states on the device (rank 0).
        predicted_model_states_bytes: the planner's.
        activations_bytes: measured bytes saved for backward (rank 0, ``memory_breakdown.activations``).
        predicted_activations_bytes: the planner's.
        tokens_per_sec: measured tokens/s per device (``throughput.tokens_per_s``, warm-up excluded).
        predicted_tokens_per_sec: the planner's; on hardware without a peak FLOP/s, calibrated (see ``speed_source``).
        speed_source: how ``predicted_tokens_per_sec`` was obtained.
        tflops_per_device: measured model TFLOP/s per device (``throughput.tflops_per_s``).
        mfu: measured model FLOPs utilisation (``throughput.mfu``; needs a peak FLOP/s).
        usd_per_1b_tokens: measured dollars per 1e9 tokens (``cost.dollars_per_1b_tokens``; needs a price).
        predicted_usd_per_1b_tokens: the planner's.
        compute_dtype: the planned matmul dtype (peak-table key).
        train_flops_per_token: the planner's FLOPs per token, recomputation included.
        price_per_device_hour: the planned hardware's price (``None``: not set).
        why_no_peak, why_no_tflops, why_no_mfu, why_no_usd, why_no_fits, why_no_prediction, why_no_predicted_usd:
            why a figure is missing (``None`` when it is there).
        error: metrics.json's ``error`` of a job that did not train (``refused``, ``failed``).
        stopped_by: the callback that stopped the fit (``stopped`` only; ``None`` if unknown).
        stopped_at_step: the optimizer step it stopped at.
    """

    job: int
    rung: str
    status: str
    predicted_fits: bool | None = None
    predicted_margin_bytes: int | None = None
    peak_memory_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    model_states_bytes: int | None = None
    predicted_model_states_bytes: int | None = None
    activations_bytes: int | None = None
    predicted_activations_bytes: int | None = None
    tokens_per_sec: float | None = None
    predicted_tokens_per_sec: float | None = None
    speed_source: str | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    usd_per_1b_tokens: float | None = None
    predicted_usd_per_1b_tokens: float | None = None
    compute_dtype: str | None = None
    train_flops_per_token: float | None = None
    price_per_device_hour: float | None = None
    why_no_peak: str | None = None
    why_no_tflops: str | None = None
    why_no_mfu: str | None = None
    why_no_usd: str | None = None
    why_no_fits: str | None = None
    why_no_prediction: str | None = None
    why_no_predicted_usd: str | None = None
    error: str | None = None
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
    measured = (metrics.get("throughput") or {}).get("tokens_per_s")
    if measured is not None:
        return float(measured)
    if metrics.get("tokens_per_sec") is not None:
        return float(metrics["tokens_per_sec"]) / int(metrics.get("world_size") or 1)
    return None


def _measured(job: int, rung: str, metrics: dict[str, Any]) -> LadderRow:
    """The measured half of a row, from the nested summaries of metrics.json (``throughput``, ``cost``, ...)."""
    tp = metrics.get("throughput") or {}
    cost = metrics.get("cost") or {}
    breakdown = metrics.get("memory_breakdown") or {}
    row = LadderRow(
        job=job,
        rung=rung,
        status=str(metrics.get("status", "failed")) if metrics else "failed",
        peak_memory_bytes=metrics.get("peak_memory_bytes"),
        model_states_bytes=_device_states(breakdown),
        activations_bytes=breakdown.get("activations"),
        tokens_per_sec=_per_device_tps(metrics),
        tflops_per_device=tp.get("tflops_per_s"),
        mfu=tp.get("mfu"),
        usd_per_1b_tokens=cost.get("dollars_per_1b_tokens"),
        stopped_by=metrics.get("stopped_by"),
        stopped_at_step=metrics.get("stopped_at_step"),
        error=metrics.get("error"),
    )
    if row.status not in ("ok", "stopped", "diverged"):
        return row  # it did not train (oom, refused, failed): its status says why nothing was measured
    if row.peak_memory_bytes is None and breakdown.get("source"):
        row.why_no_peak = f"no allocator peak: {breakdown['source']}"
    if row.tflops_per_device is None:
        row.why_no_tflops = tp.get("flops_note") or "no throughput in metrics.json (the SpeedMonitor callback is off)"
    if row.mfu is None:
        dtype = tp.get("dtype") or "<dtype>"
        row.why_no_mfu = row.why_no_tflops or (
            f"no {dtype} peak FLOP/s for {tp.get('hardware')}: set +hardware.peak_tflops.{dtype}=<TFLOP/s>"
        )
    if row.usd_per_1b_tokens is None:
        row.why_no_usd = cost.get("price_source") or "no cost in metrics.json (the CostMonitor callback is off)"
    return row


def predicted_row(job: int, rung: str, result: PlanResult, row: LadderRow | None = None) -> LadderRow:
    """Fill the predicted half of ``row`` (a new ``predicted`` row when ``None``) from ``plan(cfg)``'s result."""
    from lightning_trainopt.metrics.hardware import compute_dtype_key

    row = row or LadderRow(job=job, rung=rung, status=PREDICTED)
    e, hw = result.estimate, result.hardware
    row.predicted_fits = e.fits
    row.predicted_margin_bytes = e.margin_bytes
    if e.fits is None:
        row.why_no_fits = f"no device memory for {hw.name}: set hardware.memory_gb"
    row.predicted_peak_bytes = e.peak_device_bytes
    row.predicted_model_states_bytes = sum(
        e.memory.bytes(c, resident_only=True) for c in ("params", "grads", "optimizer_states")
    )
    row.predicted_activations_bytes = e.memory.bytes("activations")
    row.predicted_tokens_per_sec = e.speed.tokens_per_sec_per_device
    row.speed_source = f"planner: {e.speed.source}"
    row.predicted_usd_per_1b_tokens = e.speed.usd_per_1b_tokens
    row.compute_dtype = compute_dtype_key(e.inputs.trainer_precision, hw.name != "cpu")
    row.train_flops_per_token = e.train_flops_per_token
    row.price_per_device_hour = hw.price_per_device_hour
    if hw.price_per_device_hour is None:
        row.why_no_predicted_usd = hw.sources.get("price") or "no price: set hardware.price_per_device_hour"
    return row


def _predict(cfg: DictConfig, row: LadderRow) -> None:
    from lightning_trainopt.config.plan import plan

    OmegaConf.set_struct(cfg, False)
    cfg.plan = OmegaConf.create({"choices": {}})
    predicted_row(row.job, row.rung, plan(cfg), row)


def _calibrate(rows: list[LadderRow]) -> None:
    """Predict tokens/s where the hardware has no peak FLOP/s (CPU), from a measured FLOP/s of the same dtype.

    The first ``ok`` rung of each compute dtype is its calibration: its measured tokens/s x its FLOPs per token is the
    rate this machine sustains in that dtype. Every other rung of the dtype is predicted as that rate / its own FLOPs
    per token (recomputation included), so the prediction carries what the planner models (checkpointing's
    recomputation, the micro-batch) and nothing it was told.
    """
    from lightning_trainopt.planner import estimate_speed

    rates: dict[str, tuple[float, str]] = {}
    for r in rows:
        if (
            r.status == "ok"
            and r.predicted_tokens_per_sec is None
            and r.tokens_per_sec
            and r.train_flops_per_token
            and r.compute_dtype
            and r.compute_dtype not in rates
        ):
            rates[r.compute_dtype] = (r.tokens_per_sec * r.train_flops_per_token, r.rung)
    for r in rows:
        if r.predicted_tokens_per_sec is not None or not r.train_flops_per_token or r.status == PREDICTED:
            continue
        if r.compute_dtype not in rates:
            r.why_no_prediction = f"no peak FLOP/s for {r.compute_dtype} and no ok rung of that dtype to calibrate on"
            continue
        rate, on = rates[r.compute_dtype]
        speed = estimate_speed(r.train_flops_per_token, 1, 1, rate, 1.0, r.price_per_device_hour, 1e9)
        r.predicted_tokens_per_sec = speed.tokens_per_sec_per_device
        r.predicted_usd_per_1b_tokens = speed.usd_per_1b_tokens
        r.speed_source = f"{CALIBRATION} ({r.compute_dtype})" if on == r.rung else f"calibrated on {on}"


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
        row = _measured(int(job_dir.name) if job_dir.name.isdigit() else len(rows), rung, metrics)
        cfg = OmegaConf.load(job_dir / ".hydra" / "config.yaml")
        try:
            if isinstance(cfg, DictConfig):
                _predict(cfg, row)
        except TrainOptError as err:
            # A rung the planner refuses still gets its measured row; the reason is shown, not hidden.
            log.warning("planner could not predict rung %s: %s", rung, err)
            row.why_no_prediction = f"the planner refused it: {err}"
        rows.append(row)
    _calibrate(rows)
    return rows


def ladder_rungs(conf_dir: Path) -> list[str]:
    """The rungs of ``conf/experiment/ladder.yaml``'s sweep, in its order."""
    node = OmegaConf.load(Path(conf_dir) / "experiment" / "ladder.yaml")
    return [s.strip() for s in str(node.hydra.sweeper.params[f"+{RUNG_KEY}"]).split(",")]
