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
    check_compatible,
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
        "headroom_bytes": e.headroom_bytes,
        "margin_bytes": e.margin_bytes,
        "train_flops_per_token": e.train_flops_per_token,
        "tokens_per_sec_per_device": e.speed.tokens_per_sec_per_device,
        "step_time_s": e.speed.step_time_s,
        "usd_per_1b_tokens": e.speed.usd_per_1b_tokens,
        "hours_to_target": e.speed.hours_to_target,
        "usd_to_target": e.speed.usd_to_target,
        "speed_source": e.speed.source,
        "speed_measured": e.speed.source.startswith("measured"),
        "adam_path": e.inputs.adam_path,
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


# Overrides the planner writes itself in the printed command, from the planned values.
_PLANNED_KEYS = (
    "trainer.devices",
    "trainer.num_nodes",
    "data.batch_size",
    "data.seq_len",
    "trainer.accumulate_grad_batches",
)


def _task_overrides(cfg: DictConfig) -> list[str]:
    """The command-line overrides of this run: ``plan.overrides`` when an API caller gives them, else Hydra's."""
    given = _plain((cfg.get("plan") or {}).get("overrides"))
    if given:
        return [str(o) for o in given]
    try:
        from hydra.core.hydra_config import HydraConfig

        return [str(o) for o in HydraConfig.get().overrides.task]
    except ValueError:
        return []


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _command(
    cfg: DictConfig, choices: dict[str, str], inputs: PlanInputs, swapped: dict[str, str] | None = None
) -> str:
    """``python train.py`` + the user's overrides (so the same model, data and hardware compose) + the planned values.

    Args:
        cfg: the composed config.
        choices: preset names of the planned configuration (a search winner's groups included).
        inputs: the planned values (devices, micro-batch, sequence length, accumulation).
        swapped: groups a search winner replaces (group -> new preset): the user's override of the group and of
            its keys are dropped, the winner's preset is written instead.
    """
    swapped = swapped or {}
    parts = ["python train.py"]
    given = _task_overrides(cfg)
    for o in given:
        key = _override_key(o)
        group = key.split(".", 1)[0]
        if group in ("plan", "hydra") or key in _PLANNED_KEYS or group in swapped:
            continue
        parts.append(o)
    present = {_override_key(o).split(".", 1)[0] for o in parts[1:] if "." not in _override_key(o)}
    for group in ("model", "hardware", "precision", "activations", "optimizer"):
        if group in choices and (group in swapped or group not in present):
            parts.append(f"{group}={choices[group]}")
    strategy_given = "strategy" in present and "strategy" not in swapped
    if choices.get("strategy") and inputs.layout.kind != "single" and not strategy_given:
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


def _measured_tokens_per_sec(path: Any, inputs: PlanInputs, on_cuda: bool) -> float | None:
    """Per-device tokens/s of a short ``train.py`` run of the same configuration (``plan.metrics``).

    Raises:
        ConfigError: the file is missing, has no speed, or comes from a run of another model, sequence length,
            precision or device type (its speed would not apply).
    """
    if not path:
        return None
    file = Path(str(path))
    if not file.is_file():
        raise ConfigError(
            "plan.metrics", str(path), "give the metrics.json of a short train.py run (it does not exist)."
        )
    data = json.loads(file.read_text())
    expected = {
        "n_params": inputs.model.n_params(),
        "seq_len": inputs.seq_len,
        "trainer_precision": inputs.trainer_precision,
        "accelerator": "cuda" if on_cuda else "cpu",
    }
    recorded = {k: data.get(k) for k in expected}
    if recorded["accelerator"] == "gpu":
        recorded["accelerator"] = "cuda"
    wrong = [f"{k} {recorded[k]!r} (planned {v!r})" for k, v in expected.items() if recorded[k] != v]
    if wrong:
        raise ConfigError(
            "plan.metrics",
            str(path),
            "its run does not match the planned config: " + "; ".join(wrong) + ". Give the metrics.json of a "
            "train.py run of the same model, seq_len, precision and device type, or drop plan.metrics.",
        )
    world = int(data.get("world_size") or inputs.world_size)
    if data.get("tokens_per_sec_per_device"):
        return float(data["tokens_per_sec_per_device"])
    if data.get("tokens_per_sec"):
        return float(data["tokens_per_sec"]) / world
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


def _adam_path(cfg: DictConfig, on_cuda: bool) -> Callable[[PlanInputs], str]:
    """``inputs -> adam_path``: how torch Adam/AdamW runs its step in ``train.py`` (see ``model_states.ADAM_PATHS``).

    On CUDA, LitGPT gives a torch Adam/AdamW partial the fused kernel (no temporary) unless it sets ``fused`` or
    ``foreach``, the strategy is DeepSpeed (which steps the client optimizer on its flat fp32 partitions: torch's
    default there is ``foreach``), or fp16 AMP with gradient clipping (``techniques.optimizers.fused_adam_kwargs``).
    On CPU torch has no foreach kernels: the single-tensor loop, unless the node asks for ``fused``/``foreach``.
    """
    opt = cfg.get("optimizer") or {}
    fused, foreach = opt.get("fused"), opt.get("foreach")
    clip = bool((cfg.get("trainer") or {}).get("gradient_clip_val"))

    def path(inputs: PlanInputs) -> str:
        if fused is True:
            return "fused"
        if foreach is not None:
            return "foreach" if foreach else "single_tensor"
        if not on_cuda:
            return "single_tensor"
        if fused is False or inputs.layout.kind == "deepspeed":
            return "foreach"  # torch's CUDA default when the fused kernel is not asked for
        return "foreach" if inputs.trainer_precision == "16-mixed" and clip else "fused"

    return path


def _allowed(cfg: DictConfig, on_cuda: bool) -> Callable[[dict[str, str], PlanInputs], bool]:
    """``(choices, inputs) -> bool`` for the search: does ``train.py``'s pre-flight accept the candidate?"""
    from lightning_trainopt.exceptions import IncompatibleConfigError

    conf = _conf_dir(cfg)

    def allowed(choices: dict[str, str], inputs: PlanInputs) -> bool:
        strategy = load_preset(conf, "strategy", choices["strategy"]) if choices.get("strategy") else None
        target = str(load_preset(conf, "optimizer", choices["optimizer"]).get("_target_", ""))
        try:
            check_compatible(strategy, inputs.trainer_precision, target, on_cuda, cfg.get("callbacks"))
        except IncompatibleConfigError:
            return False
        return True

    return allowed


def plan(cfg: DictConfig) -> PlanResult:
    """Estimate a composed ``plan.py`` / ``train.py`` config (no Trainer, no device, no memory allocated).

    Args:
        cfg: the composed config (``conf/plan.yaml``: the groups of ``train.py`` plus a ``plan`` node).

    Raises:
        ConfigError: a value the planner cannot plan, named with its key and the fix.
    """
    plan_cfg = cfg.get("plan") or OmegaConf.create({})
    _check_top_k(plan_cfg.get("top_k", 10))
    hardware = hardware_from_cfg(cfg.get("hardware"))
    on_cuda = hardware.name != "cpu"
    choices = _choices(cfg)
    adam_path = _adam_path(cfg, on_cuda)
    base = build_plan_inputs(cfg, choices.get("activations", "none"))
    inputs = replace(base, adam_path=adam_path(base))
    mfu = float(plan_cfg.get("mfu", 0.4))
    target = float(plan_cfg.get("target_tokens", 1e9))
    headroom = float(plan_cfg.get("headroom_fraction", 0.0))
    measured = _measured_tokens_per_sec(plan_cfg.get("metrics"), inputs, on_cuda)

    def run(i: PlanInputs) -> PlanEstimate:
        # A measured speed belongs to the configuration that ran; every other candidate keeps the FLOPs model.
        peak = hardware.peak(compute_dtype_key(i.trainer_precision, on_cuda))
        tps = measured if i == inputs else None
        return estimate_plan(i, hardware.memory_bytes, peak, hardware.price_per_device_hour, mfu, target, tps, headroom)

    est = run(inputs)
    n = inputs.model.n_params()
    textbook = {s: textbook_model_state_bytes(n, s) for s in ("fp32", "mixed")}
    if not plan_cfg.get("search", False):
        return PlanResult(est, hardware, choices, _command(cfg, choices, inputs), textbook=textbook)
    space = _search_space(cfg, inputs.world_size)
    ranked, n_enum = search_plans(inputs, space, run, adam_path, _allowed(cfg, on_cuda))
    cmd = ""
    if ranked:
        win = ranked[0]
        swapped = {g: p for g, p in win.choices.items() if choices.get(g) != p}
        cmd = _command(cfg, {**choices, **win.choices}, win.estimate.inputs, swapped)
    return PlanResult(est, hardware, choices, cmd, ranked, n_enum, textbook)


def _check_top_k(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("plan.top_k", value, "use a positive number of rows, e.g. plan.top_k=10.")
    return value


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
        print_plan(result, top_k=_check_top_k((cfg.get("plan") or {}).get("top_k", 10)))
    return result
