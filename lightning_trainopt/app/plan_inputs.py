"""Turn the Hydra config tree (the same groups as ``train.py``) into the planner's plain inputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.core.estimate import (
    ActivationPolicy,
    OptimizerStateModel,
    PlanInputs,
    StrategyLayout,
    optimizer_state_model,
)
from lightning_trainopt.core.hardware import HardwareSpec, hardware_spec
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.models.config import GPTConfig

__all__ = [
    "activation_policy",
    "build_plan_inputs",
    "check_compatible",
    "hardware_from_cfg",
    "load_preset",
    "optimizer_from_cfg",
    "strategy_layout",
]


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def strategy_layout(node: Any, world_size: int) -> StrategyLayout:
    """The layout of a ``conf/strategy`` preset node (``None``: Lightning's default for ``world_size`` devices).

    Raises:
        ConfigError: a strategy the planner does not model.
    """
    node = _plain(node)
    if not node:
        return StrategyLayout(name="ddp" if world_size > 1 else "single", kind="ddp" if world_size > 1 else "single")
    target = str(node.get("_target_", ""))
    name = str(node.get("name") or target.rsplit(".", 1)[-1])
    if "deepspeed" in target.lower() or "stage" in node:
        off_opt = "none"
        if node.get("offload_optimizer"):
            off_opt = str(node.get("offload_optimizer_device", "cpu"))
        off_par = "none"
        if node.get("offload_parameters"):
            off_par = str(node.get("offload_params_device", "cpu"))
        return StrategyLayout(
            name=name,
            kind="deepspeed",
            zero_stage=int(node.get("stage", 2)),
            offload_optimizer=off_opt,
            offload_params=off_par,
            reduce_bucket_size=int(node.get("reduce_bucket_size", 200_000_000)),
            param_persistence_threshold=int(node.get("param_persistence_threshold", 100_000)),
            # Lightning's DeepSpeedStrategy defaults; the stage-3 gather knobs are not Lightning arguments, so
            # DeepSpeed's own defaults apply (runtime/zero/config.py).
            overlap_comm=bool(node.get("overlap_comm", True)),
            contiguous_gradients=bool(node.get("contiguous_gradients", True)),
        )
    if "fsdp" in name.lower() or "fsdp" in target.lower() or "modelparallel" in target.lower():
        offload = any("offload" in str(k).lower() and v for d in _walk(node) for k, v in d.items())
        return StrategyLayout(
            name=name,
            kind="fsdp",
            offload_params="cpu" if offload else "none",
            offload_optimizer="cpu" if offload else "none",
        )
    if "ddp" in target.lower() or name == "ddp":
        return StrategyLayout(name=name, kind="ddp" if world_size > 1 else "single")
    raise ConfigError("strategy._target_", target, "the planner models ddp, zero1/2/3 (+offload, infinity) and fsdp.")


def activation_policy(node: Any, name: str = "none") -> ActivationPolicy:
    """The policy of a ``conf/activations`` preset: every ``_target_`` in it is read for what it changes."""
    every, offload, bits, block, min_numel = 0, False, None, 64, 1024
    for d in _walk(_plain(node) or {}):
        target = str(d.get("_target_", "")).lower()
        if "checkpoint" in target:
            every = int(next((x["every_k"] for x in _walk(d) if "every_k" in x), 1))
        elif "offload" in target:
            offload = True
        elif "compression" in target or "compress" in target:
            bits = int(d.get("bits", 8))
            block = int(d.get("block_size", block))
            min_numel = int(d.get("min_numel", min_numel))
    return ActivationPolicy(every, offload, bits, block, min_numel, name=name)


def optimizer_from_cfg(node: Any, name: str | None = None) -> OptimizerStateModel:
    """The state model of a ``conf/optimizer`` preset."""
    node = _plain(node) or {}
    return optimizer_state_model(str(node.get("_target_", "torch.optim.AdamW")), name)


def hardware_from_cfg(node: Any) -> HardwareSpec:
    """The :class:`HardwareSpec` of a ``conf/hardware`` preset (instantiated, or read as plain keys)."""
    node = _plain(node) or {}
    if node.get("_target_"):
        from hydra.utils import instantiate

        spec = instantiate(node)
        if isinstance(spec, HardwareSpec):
            return spec
    keys = ("name", "price_per_device_hour", "peak_tflops", "memory_gb")
    return hardware_spec(**{k: node[k] for k in keys if k in node})


def load_preset(conf_dir: Path, group: str, name: str) -> DictConfig:
    """Read ``conf/<group>/<name>.yaml`` (following its own ``defaults`` within the group).

    Raises:
        ConfigError: no such preset.
    """
    path = conf_dir / group / f"{name}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        raise ConfigError(f"plan.search_space.{group}", name, f"use presets that exist: {', '.join(have)}.")
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise ConfigError(f"plan.search_space.{group}", name, "that preset is not a mapping; use a config-group file.")
    defaults = node.pop("defaults", [])
    base: Any = OmegaConf.create()
    for entry in defaults:
        if isinstance(entry, str) and entry != "_self_":
            base = OmegaConf.merge(base, load_preset(conf_dir, group, entry))
    merged = OmegaConf.merge(base, node)
    assert isinstance(merged, DictConfig)
    return merged


def _devices(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, (list, tuple)) and value:
        return len(value)
    raise ConfigError(
        "trainer.devices", value, "the planner needs an explicit device count per node, e.g. trainer.devices=8."
    )


def check_compatible(
    strategy: Any, trainer_precision: str, optimizer_target: str | None, on_cuda: bool, callbacks: Any = None
) -> None:
    """Refuse what ``train.py``'s pre-flight refuses (``app.preflight.RULES``), for the planned hardware.

    The same rules run for the given config and for every search candidate, so ``plan.py`` refuses exactly what
    ``train.py`` refuses and the search enumerates exactly what it accepts. Rules about this machine
    (``Rule.machine_specific``: a system library) and the NVMe path checks are left to ``train.py`` on the machine
    that trains.

    Args:
        strategy: the ``strategy`` node (``None``: Lightning's default).
        trainer_precision: Lightning precision string.
        optimizer_target: the optimizer's ``_target_``.
        on_cuda: the planned hardware has CUDA devices (``hardware`` is not ``cpu``).
        callbacks: the ``callbacks`` node (for callback rules).

    Raises:
        IncompatibleConfigError: the combination ``train.py`` would refuse, with its reason and fix.
    """
    from lightning_trainopt.app.preflight import RULES, PreflightInput

    # Only the callbacks' _target_ strings matter; resolving whole nodes would fail outside a Hydra run on
    # interpolations such as ${hydra:runtime.output_dir} (the notebook, the ladder's report callback).
    nodes = callbacks.values() if isinstance(callbacks, (DictConfig, dict)) else ()
    targets = tuple(str(v.get("_target_", "")) for v in nodes if isinstance(v, (DictConfig, dict)))
    p = PreflightInput(
        strategy=_plain(strategy) or None,
        precision=trainer_precision,
        optimizer_target=optimizer_target,
        accelerator="gpu" if on_cuda else "cpu",
        callback_targets=targets,
    )
    for rule in RULES:
        if not rule.machine_specific and rule.applies(p):
            raise IncompatibleConfigError(rule.keys(p), rule.reason, rule.fix)


def build_plan_inputs(cfg: DictConfig, activations_name: str = "none") -> PlanInputs:
    """The planner's inputs for a composed ``train.py``/``plan.py`` config.

    Raises:
        ConfigError: a value the planner cannot plan (e.g. ``trainer.devices=-1``, a foreign model,
            ``trainer.accumulate_grad_batches=0``).
        IncompatibleConfigError: a combination ``train.py``'s pre-flight refuses (:func:`check_compatible`).
    """
    model = _plain(cfg.model)
    target = str(model.pop("_target_", "lightning_trainopt.models.GPTConfig"))
    if not target.endswith("GPTConfig"):
        raise ConfigError(
            "model._target_",
            target,
            "plan.py plans GPTConfig models; for another nn.Module use measure_activation_bytes.",
        )
    gpt = GPTConfig(**model)
    devices = _devices(cfg.trainer.get("devices", 1))
    nodes = int(cfg.trainer.get("num_nodes", 1))
    layout = strategy_layout(cfg.get("strategy"), devices * nodes)
    optimizer = optimizer_from_cfg(cfg.optimizer)
    trainer_precision = str(cfg.precision.trainer_precision)
    on_cuda = hardware_from_cfg(cfg.get("hardware")).name != "cpu"
    check_compatible(
        cfg.get("strategy"), trainer_precision, str(cfg.optimizer.get("_target_", "")), on_cuda, cfg.get("callbacks")
    )
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches", accumulate, "use a positive integer (1 = no accumulation)."
        )
    return PlanInputs(
        model=gpt,
        trainer_precision=trainer_precision,
        layout=layout,
        optimizer=optimizer,
        activations=activation_policy(cfg.get("activations"), activations_name),
        micro_batch=int(cfg.data.batch_size),
        seq_len=int(cfg.data.seq_len),
        accumulate=accumulate,
        devices=devices,
        num_nodes=nodes,
        attention=str(cfg.get("plan", {}).get("attention", "sdpa")),
    )
