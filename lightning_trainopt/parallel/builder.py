"""Map a ``conf/strategy`` preset into the keyword arguments of its strategy (:func:`strategy_kwargs`), and report the
strategy a run used.

Plain values in, plain values out: the node is read from the composed config and instantiated in
``config/strategy.py`` (``build_strategy``), so nothing here reads Hydra or OmegaConf.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import Strategy

from lightning_trainopt.exceptions import ConfigError, MissingDependencyError
from lightning_trainopt.optim.schedules import peak_lr
from lightning_trainopt.parallel.spec import BUCKET_KEYS, StrategySpec, resolve_target
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["preset_name", "strategy_info", "strategy_kwargs"]


def _log2_int(value: float, key: str) -> int:
    power = math.log2(value)
    if power != int(power):
        raise ConfigError(key, value, "DeepSpeed's dynamic loss scale starts at a power of two; use e.g. 65536.")
    return int(power)


def strategy_kwargs(
    spec: StrategySpec,
    node: Mapping[str, Any],
    precision: PrecisionSpec,
    trainer: Mapping[str, Any] | None = None,
    micro_batch_size: int | None = None,
    n_params: int | None = None,
) -> dict[str, Any]:
    """The node to instantiate for ``spec``: the preset's ``_target_`` and keyword arguments, with what the builder
    fills for DeepSpeed.

    For DeepSpeed presets the builder fills what DeepSpeed would otherwise guess or take from elsewhere:

    * ``train_micro_batch_size_per_gpu`` <- ``micro_batch_size`` (the datamodule's ``data.batch_size``),
    * ``reduce_bucket_size``/``allgather_bucket_size: auto`` (the ZeRO-1/2 presets) <- the model's parameter count
      ``n_params``, at most 5e7 elements (the planner sizes them the same way); a number is used as given,
    * fp16 loss scaling: ``initial_scale_power = log2(precision.init_scale)``,
      ``loss_scale_window = precision.growth_interval``,
    * gradient accumulation and clipping come from the Trainer (``trainer.accumulate_grad_batches``,
      ``trainer.gradient_clip_val``) when the strategy sets up, exactly as Lightning does.

    Args:
        spec: what the node means (:func:`~lightning_trainopt.parallel.spec.parse_strategy` of ``node``).
        node: the ``strategy`` node as a plain mapping (``_target_``, ``name`` and keyword arguments).
        precision: the precision preset.
        trainer: the ``trainer`` node as a plain mapping (only checked here; the Trainer passes its values at setup).
        micro_batch_size: micro-batch per device.
        n_params: the model's parameter count, for ``auto`` bucket sizes (``None``: unknown, the 5e7 cap applies).

    Raises:
        ConfigError: a missing ``_target_``, a non-positive micro-batch, a loss scale that is not a power of two, or a
            clipping-by-value request under DeepSpeed.
        MissingDependencyError: a DeepSpeed preset without DeepSpeed installed.
    """
    kwargs = {str(k): v for k, v in node.items()}
    target = kwargs.get("_target_")
    if not target:
        raise ConfigError("strategy._target_", target, "pick a preset with +strategy=NAME (see conf/strategy/).")
    kwargs.pop("name", None)
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ConfigError("data.batch_size", micro_batch_size, "use a positive integer micro-batch.")
    if spec.zero is not None:
        _require_deepspeed(spec.name)
        _map_deepspeed(kwargs, spec.with_buckets_for(n_params), precision, trainer, micro_batch_size)
    return kwargs


def _require_deepspeed(name: str) -> None:
    """Name the pip extra when DeepSpeed is missing, instead of Hydra's traceback from deep inside the strategy."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise MissingDependencyError("deepspeed", "deepspeed", f"+strategy={name}") from None


def _map_deepspeed(
    node: dict[str, Any],
    spec: StrategySpec,
    precision: PrecisionSpec,
    trainer_cfg: Mapping[str, Any] | None,
    micro_batch_size: int | None,
) -> None:
    from lightning_trainopt.parallel.deepspeed import TrainOptDeepSpeedStrategy

    if issubclass(resolve_target(spec.target), TrainOptDeepSpeedStrategy):
        node.setdefault("preset", spec.name)
    trainer = dict(trainer_cfg or {})
    if trainer.get("gradient_clip_algorithm") == "value":
        raise ConfigError(
            "trainer.gradient_clip_algorithm", "value", "DeepSpeed clips by norm only; set it to 'norm' or remove it."
        )
    if spec.config is not None:
        # The user's JSON as the spec read it (from a path or a mapping): the micro-batch is filled in this copy,
        # never in the user's file.
        config = copy.deepcopy(dict(spec.config))
        if micro_batch_size is not None:
            config.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
        node["config"] = config
        if "train_batch_size" in config:
            _check_train_batch_size(config, trainer)
    elif micro_batch_size is not None:
        node["logging_batch_size_per_gpu"] = micro_batch_size
    if spec.zero is not None:
        for key in BUCKET_KEYS:
            if key in node:
                node[key] = getattr(spec.zero, key)
    if precision.is_fp16:
        if precision.init_scale is not None:
            node["initial_scale_power"] = _log2_int(precision.init_scale, "precision.init_scale")
        if precision.growth_interval is not None:
            node["loss_scale_window"] = precision.growth_interval


def _check_train_batch_size(config: dict[str, Any], trainer: dict[Any, Any]) -> None:
    """Refuse a JSON ``train_batch_size`` that the micro-batch and world size cannot make, before any spawn.

    Only when the world size is known here (integer ``trainer.devices`` and ``trainer.num_nodes``); the strategy
    repeats the check at set-up in every case.
    """
    from lightning_trainopt.parallel.deepspeed import TrainOptDeepSpeedStrategy

    micro = config.get("train_micro_batch_size_per_gpu")
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if not (isinstance(micro, int) and isinstance(devices, int) and isinstance(nodes, int) and devices > 0):
        return
    accumulate = trainer.get("accumulate_grad_batches", 1)
    TrainOptDeepSpeedStrategy.accumulation_for_train_batch_size(
        config["train_batch_size"], micro, devices * nodes, accumulate if isinstance(accumulate, int) else 1
    )


def preset_name(strategy: Strategy | str) -> str:
    """The preset a strategy was built from (``ddp``, ``zero3``, ...), or its lower-case class name without
    ``Strategy`` (``singledevice`` for Lightning's ``SingleDeviceStrategy``), as metrics.json documents it."""
    if isinstance(strategy, str):
        return strategy
    name = getattr(strategy, "trainopt_preset", None) or getattr(strategy, "preset", None)
    return str(name) if name else type(strategy).__name__.removesuffix("Strategy").lower()


def strategy_info(trainer: Any) -> dict[str, Any]:
    """``{"strategy": preset, "zero_stage": stage the DeepSpeed engine runs (None otherwise), "offload": ...,
    "optimizer": {"name": class the DeepSpeed engine steps with, "lr": its first group's configured (peak) rate,
    "lr_now": the rate the schedule has set now} or None}``."""
    strategy = trainer.strategy
    info: dict[str, Any] = {"strategy": preset_name(strategy), "zero_stage": None, "offload": None, "optimizer": None}
    engine = getattr(strategy, "model", None)
    if engine is not None and hasattr(engine, "zero_optimization_stage"):
        info["zero_stage"] = int(engine.zero_optimization_stage())
        info["offload"] = {
            "optimizer": _offload_device(engine.zero_offload_optimizer()),
            "param": _offload_device(engine.zero_offload_param()),
        }
        basic = getattr(engine, "basic_optimizer", None)
        if basic is not None:
            group = basic.param_groups[0]
            info["optimizer"] = {"name": type(basic).__name__, "lr": peak_lr(group), "lr_now": float(group["lr"])}
    return info


def _offload_device(offload_config: Any) -> str:
    device = getattr(offload_config, "device", None)
    if device is None:
        return "none"
    return str(getattr(device, "value", device))
