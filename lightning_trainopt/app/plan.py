"""``plan(cfg)``: per-device memory, speed and dollars of a ``train.py`` config, before launch, without the hardware.

``python plan.py <the same overrides as train.py>`` prints the derivation; ``plan.format=json`` prints JSON;
``plan.search=true`` enumerates precision x strategy x activations x optimizer x micro-batch and ranks what fits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.app.plan_inputs import (
    activation_policy,
    build_plan_inputs,
    hardware_from_cfg,
    load_preset,
    optimizer_from_cfg,
    strategy_layout,
)
from lightning_trainopt.core.estimate import (
    Candidate,
    PlanEstimate,
    PlanInputs,
    SearchSpace,
    estimate_plan,
    search_plans,
    textbook_model_state_bytes,
)
from lightning_trainopt.core.hardware import HardwareSpec, compute_dtype_key
from lightning_trainopt.exceptions import ConfigError

__all__ = ["PlanResult", "plan", "plan_task"]

_DEFAULT_CONF = Path(__file__).resolve().parents[2] / "conf"


@dataclass(frozen=True)
class PlanResult:
    """What ``plan(cfg)`` returns.

    Args:
        estimate: the planner's answer for the configuration as given.
        hardware: the device planned for.
        choices: config group -> preset name of the given configuration (for the ``train.py`` command).
        command: the ``python train.py ...`` command of the configuration (or of the search winner).
        candidates: with ``plan.search=true``, the fitting configurations ranked best first.
        n_enumerated: with ``plan.search=true``, how many configurations were estimated.
        textbook: the design articles' 16 B/param accounting of the same model, for comparison.

    Example::

        result = plan(cfg)
        result.to_dict()["per_device_bytes"]["total"]
    """

    estimate: PlanEstimate
    hardware: HardwareSpec
    choices: dict[str, str]
    command: str
    candidates: list[Candidate] = field(default_factory=list)
    n_enumerated: int = 0
    textbook: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def winner(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view (``plan.format=json``)."""
        out = _estimate_dict(self.estimate)
        out.update(
            {
                "hardware": self.hardware.name,
                "choices": dict(self.choices),
                "command": self.command,
                "textbook_model_state_bytes": self.textbook,
            }
        )
        if self.candidates or self.n_enumerated:
            out["search"] = {
                "n_enumerated": self.n_enumerated,
                "n_fit": len(self.candidates),
                "top": [
                    {
                        "choices": c.choices,
                        "micro_batch": c.estimate.inputs.micro_batch,
                        "accumulate": c.estimate.inputs.accumulate,
                        "reason": c.reason,
                        **_estimate_dict(c.estimate),
                    }
                    for c in self.candidates[:10]
                ],
            }
        return out


def _estimate_dict(e: PlanEstimate) -> dict[str, Any]:
    mem = e.memory
    return {
        "n_params": e.inputs.model.n_params(),
        "world_size": e.inputs.world_size,
        "micro_batch": e.inputs.micro_batch,
        "seq_len": e.inputs.seq_len,
        "per_device_bytes": mem.per_device(),
        "peak_bytes": e.peak_device_bytes,
        "cpu_bytes": mem.bytes(location="cpu"),
        "nvme_bytes": mem.bytes(location="nvme"),
        "memory_breakdown": {c: mem.by_location(c) for c in ("params", "grads", "optimizer_states")},
        "device_memory_bytes": e.device_memory_bytes,
        "fits": e.fits,
        "margin_bytes": e.margin_bytes,
        "train_flops_per_token": e.train_flops_per_token,
        "tokens_per_sec_per_device": e.speed.tokens_per_sec_per_device,
        "step_time_s": e.speed.step_time_s,
        "usd_per_1b_tokens": e.speed.usd_per_1b_tokens,
        "hours_to_target": e.speed.hours_to_target,
        "usd_to_target": e.speed.usd_to_target,
        "speed_source": e.speed.source,
        "terms": [
            {
                "category": t.category,
                "location": t.location,
                "label": t.label,
                "bytes": t.nbytes,
                "formula": t.formula,
                "phase": t.phase,
            }
            for t in mem.terms
        ],
    }


def _choices(cfg: DictConfig) -> dict[str, str]:
    """Preset names of the composed config (Hydra's runtime choices when running under ``@hydra.main``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        runtime = dict(HydraConfig.get().runtime.choices)
    except ValueError:
        runtime = {}
    plan_cfg = cfg.get("plan") or {}
    given = dict(_plain(plan_cfg.get("choices")) or {})
    out = {}
    for group in ("model", "precision", "strategy", "activations", "optimizer", "hardware"):
        name = given.get(group) or runtime.get(group)
        if name is None and group in ("model", "precision", "strategy") and cfg.get(group) is not None:
            name = cfg[group].get("name")
        if name is not None and str(name) not in ("null", "None"):
            out[group] = str(name)
    return out


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _command(cfg: DictConfig, choices: dict[str, str], inputs: PlanInputs) -> str:
    parts = ["python train.py"]
    for group in ("model", "hardware", "precision", "activations", "optimizer"):
        if group in choices:
            parts.append(f"{group}={choices[group]}")
    if choices.get("strategy") and inputs.layout.kind != "single":
        parts.append(f"+strategy={choices['strategy']}")
    parts += [
        f"trainer.devices={inputs.devices}",
        f"data.batch_size={inputs.micro_batch}",
        f"data.seq_len={inputs.seq_len}",
        f"trainer.accumulate_grad_batches={inputs.accumulate}",
    ]
    if inputs.num_nodes > 1:
        parts.append(f"trainer.num_nodes={inputs.num_nodes}")
    return " ".join(parts)


def _measured_tokens_per_sec(path: Any, world_size: int) -> float | None:
    if not path:
        return None
    file = Path(str(path))
    if not file.is_file():
        raise ConfigError(
            "plan.metrics", str(path), "give the metrics.json of a short train.py run (it does not exist)."
        )
    data = json.loads(file.read_text())
    if data.get("tokens_per_sec_per_device"):
        return float(data["tokens_per_sec_per_device"])
    if data.get("tokens_per_sec"):
        return float(data["tokens_per_sec"]) / int(data.get("world_size", world_size))
    raise ConfigError("plan.metrics", str(path), "that metrics.json has no tokens_per_sec; run train.py longer.")


def _conf_dir(cfg: DictConfig) -> Path:
    given = (cfg.get("plan") or {}).get("conf_dir")
    return Path(str(given)) if given else _DEFAULT_CONF


def _search_space(cfg: DictConfig, world_size: int) -> SearchSpace:
    conf = _conf_dir(cfg)
    space = _plain(cfg.plan.search_space)
    precisions = {n: str(load_preset(conf, "precision", n).trainer_precision) for n in space["precision"]}
    strategies = {}
    for n in space["strategy"]:
        if not (conf / "strategy" / f"{n}.yaml").is_file():
            continue  # presets another group is still adding; the search covers the ones that exist
        strategies[n] = strategy_layout(load_preset(conf, "strategy", n), world_size)
    activations = {
        n: activation_policy(load_preset(conf, "activations", n), n)
        for n in space["activations"]
        if (conf / "activations" / f"{n}.yaml").is_file()
    }
    optimizers = {
        n: optimizer_from_cfg(load_preset(conf, "optimizer", n), n)
        for n in space["optimizer"]
        if (conf / "optimizer" / f"{n}.yaml").is_file()
    }
    return SearchSpace(precisions, strategies, activations, optimizers, tuple(int(b) for b in space["micro_batch"]))


def _adam_foreach_path(cfg: DictConfig, on_cuda: bool) -> Callable[[str], bool]:
    """``trainer_precision -> bool``: does torch Adam/AdamW take its multi-tensor (foreach) path?

    That path's ``_foreach_sqrt`` makes a temporary as large as the second moments. On CUDA, LitGPT gives the
    ``adamw`` preset the fused kernel (no temporary) except for fp16 AMP with gradient clipping
    (``techniques.optimizers.fused_adam_kwargs``); an optimizer node that sets ``fused``/``foreach`` decides itself.
    """
    opt = cfg.get("optimizer") or {}
    fused, foreach = opt.get("fused"), opt.get("foreach")
    clip = bool((cfg.get("trainer") or {}).get("gradient_clip_val"))

    def takes_foreach(trainer_precision: str) -> bool:
        if not on_cuda or fused is True:
            return False
        if foreach is not None:
            return bool(foreach)
        if fused is False:
            return True  # torch's CUDA default
        return trainer_precision == "16-mixed" and clip

    return takes_foreach


def plan(cfg: DictConfig) -> PlanResult:
    """Estimate a composed ``plan.py`` / ``train.py`` config (no Trainer, no device, no memory allocated).

    Args:
        cfg: the composed config (``conf/plan.yaml``: the groups of ``train.py`` plus a ``plan`` node).

    Raises:
        ConfigError: a value the planner cannot plan, named with its key and the fix.
    """
    plan_cfg = cfg.get("plan") or OmegaConf.create({})
    hardware = hardware_from_cfg(cfg.get("hardware"))
    choices = _choices(cfg)
    foreach = _adam_foreach_path(cfg, on_cuda=hardware.name != "cpu")
    base = build_plan_inputs(cfg, choices.get("activations", "none"))
    inputs = replace(base, foreach=foreach(base.trainer_precision))
    mfu = float(plan_cfg.get("mfu", 0.4))
    target = float(plan_cfg.get("target_tokens", 1e9))
    measured = _measured_tokens_per_sec(plan_cfg.get("metrics"), inputs.world_size)
    on_cuda = hardware.name != "cpu"

    def run(i: PlanInputs, measured_tps: float | None = None) -> PlanEstimate:
        peak = hardware.peak(compute_dtype_key(i.trainer_precision, on_cuda))
        return estimate_plan(i, hardware.memory_bytes, peak, hardware.price_per_device_hour, mfu, target, measured_tps)

    est = run(inputs, measured)
    n = inputs.model.n_params()
    textbook = {s: textbook_model_state_bytes(n, s) for s in ("fp32", "mixed")}
    if not plan_cfg.get("search", False):
        return PlanResult(est, hardware, choices, _command(cfg, choices, inputs), textbook=textbook)
    ranked, n_enum = search_plans(inputs, _search_space(cfg, inputs.world_size), run, foreach)
    cmd = ""
    if ranked:
        win = ranked[0]
        cmd = _command(cfg, {**choices, **win.choices}, win.estimate.inputs)
    return PlanResult(est, hardware, choices, cmd, ranked, n_enum, textbook)


def plan_task(cfg: DictConfig) -> PlanResult:
    """The ``@hydra.main`` task of ``plan.py``: plan and print (rich screen or JSON)."""
    from lightning_trainopt.app.plan_report import print_plan

    fmt = str((cfg.get("plan") or {}).get("format", "rich"))
    if fmt not in ("rich", "json"):
        raise ConfigError("plan.format", fmt, "use rich or json.")
    result = plan(cfg)
    if fmt == "json":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print_plan(result, top_k=int((cfg.get("plan") or {}).get("top_k", 10)))
    return result
