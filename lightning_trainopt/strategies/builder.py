"""Build the Trainer's strategy from a ``conf/strategy`` preset, mapping our config into the strategy's."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.strategies import Strategy
from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.core.estimate.model_states import MODEL_SIZED_BUCKET_CAP, model_sized_bucket
from lightning_trainopt.core.schedules import peak_lr
from lightning_trainopt.exceptions import ConfigError, MissingDependencyError
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["BUCKET_KEYS", "bucket_elements", "build_strategy", "preset_name", "strategy_info"]

_RESERVED = ("_target_", "_recursive_", "_convert_", "_partial_", "_args_")
#: DeepSpeed bucket arguments a preset may set to ``auto``: sized to the model (:func:`model_sized_bucket`).
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size")


def _log2_int(value: float, key: str) -> int:
    power = math.log2(value)
    if power != int(power):
        raise ConfigError(key, value, "DeepSpeed's dynamic loss scale starts at a power of two; use e.g. 65536.")
    return int(power)


def _is_deepspeed_target(target: str) -> bool:
    return target.rsplit(".", 1)[-1] in ("TrainOptDeepSpeedStrategy", "DeepSpeedStrategy")


def build_strategy(
    strategy_cfg: DictConfig | dict[str, Any] | None,
    precision: PrecisionSpec,
    trainer_cfg: DictConfig | dict[str, Any] | None = None,
    micro_batch_size: int | None = None,
    n_params: int | None = None,
) -> Strategy | str:
    """Instantiate a strategy preset (``cfg.strategy``), or return ``"auto"`` when there is none.

    For DeepSpeed presets the builder fills what DeepSpeed would otherwise guess or take from elsewhere:

    * ``train_micro_batch_size_per_gpu`` <- ``micro_batch_size`` (the datamodule's ``data.batch_size``),
    * ``reduce_bucket_size``/``allgather_bucket_size: auto`` (the ZeRO-1/2 presets) <- the model's parameter count
      ``n_params``, at most 5e7 elements (the planner sizes them the same way); a number is used as given,
    * fp16 loss scaling: ``initial_scale_power = log2(precision.init_scale)``,
      ``loss_scale_window = precision.growth_interval``,
    * gradient accumulation and clipping come from the Trainer (``trainer.accumulate_grad_batches``,
      ``trainer.gradient_clip_val``) when the strategy sets up, exactly as Lightning does.

    Args:
        strategy_cfg: the ``strategy`` node (``_target_``, ``name`` and keyword arguments) or ``None``.
        precision: the precision preset.
        trainer_cfg: the ``trainer`` node (only checked here; the Trainer itself passes its values at setup).
        micro_batch_size: micro-batch per device.
        n_params: the model's parameter count, for ``auto`` bucket sizes (``None``: unknown, the 5e7 cap applies).

    Raises:
        ConfigError: a missing ``_target_``, a non-positive micro-batch, a loss scale that is not a power of two,
            a bucket size that is neither a positive whole number nor ``auto``, or a clipping-by-value request
            under DeepSpeed.
    """
    if strategy_cfg is None:
        return "auto"
    from hydra.utils import instantiate

    if isinstance(strategy_cfg, DictConfig):
        for key in strategy_cfg:
            if OmegaConf.is_missing(strategy_cfg, key):
                raise ConfigError(
                    f"strategy.{key}", "???", f"this preset needs it: add strategy.{key}=... to the command."
                )
        node = OmegaConf.to_container(strategy_cfg, resolve=True)
    else:
        node = dict(strategy_cfg)
    assert isinstance(node, dict)
    target = node.get("_target_")
    if not target:
        raise ConfigError("strategy._target_", target, "pick a preset with +strategy=NAME (see conf/strategy/).")
    name = str(node.pop("name", target.rsplit(".", 1)[-1]))
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ConfigError("data.batch_size", micro_batch_size, "use a positive integer micro-batch.")

    if _is_deepspeed_target(target):
        _require_deepspeed(name)
        _map_deepspeed(node, name, precision, trainer_cfg, micro_batch_size)
        for key in BUCKET_KEYS:
            if key in node:
                node[key] = bucket_elements(f"strategy.{key}", node[key], n_params)
    strategy = instantiate(node, _convert_="all")
    if not isinstance(strategy, Strategy):
        raise ConfigError("strategy._target_", target, "point it at a lightning.pytorch Strategy class.")
    strategy.trainopt_preset = name  # type: ignore[attr-defined]
    return strategy


def bucket_elements(key: str, value: Any, n_params: int | None) -> int:
    """The elements of a DeepSpeed bucket argument: ``auto`` -> :func:`model_sized_bucket` of ``n_params``.

    Args:
        key: the config key, for the error.
        value: the preset's or the user's value: a positive whole number (``5e7`` passes) or ``auto``.
        n_params: the model's parameter count; ``None`` (unknown) gives ``auto`` the cap of 5e7 elements.

    Raises:
        ConfigError: neither ``auto`` nor a positive whole number.
    """
    if value == "auto":
        return MODEL_SIZED_BUCKET_CAP if n_params is None else model_sized_bucket(n_params)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ConfigError(
            key, value, "use a positive whole number of elements, or auto (the model's parameter count, at most 5e7)."
        )
    return int(value)


def _require_deepspeed(name: str) -> None:
    """Name the pip extra when DeepSpeed is missing, instead of Hydra's traceback from deep inside the strategy."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise MissingDependencyError("deepspeed", "deepspeed", f"+strategy={name}") from None


def _map_deepspeed(
    node: dict[str, Any],
    name: str,
    precision: PrecisionSpec,
    trainer_cfg: DictConfig | dict[str, Any] | None,
    micro_batch_size: int | None,
) -> None:
    if node["_target_"].endswith("TrainOptDeepSpeedStrategy"):
        node.setdefault("preset", name)
    trainer = dict(trainer_cfg or {})
    if trainer.get("gradient_clip_algorithm") == "value":
        raise ConfigError(
            "trainer.gradient_clip_algorithm", "value", "DeepSpeed clips by norm only; set it to 'norm' or remove it."
        )
    user_json = node.get("config")
    if micro_batch_size is not None:
        if isinstance(user_json, dict):
            user_json.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
        elif user_json is None:
            node["logging_batch_size_per_gpu"] = micro_batch_size
        else:
            # A path: load it here so the micro-batch can be filled without touching the user's file.
            from lightning_trainopt.strategies.deepspeed_json import load_deepspeed_json

            loaded = load_deepspeed_json(user_json)
            loaded.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
            node["config"] = loaded
    if isinstance(node.get("config"), dict) and "train_batch_size" in node["config"]:
        _check_train_batch_size(node["config"], trainer)
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
    from lightning_trainopt.strategies.deepspeed import TrainOptDeepSpeedStrategy

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
