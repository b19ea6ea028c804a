"""DeepSpeed's ZeRO settings as plain data (:class:`ZeroSpec`), read from a DeepSpeed config as DeepSpeed reads it.

The vocabulary in one place: DeepSpeed's ``zero_optimization`` keys, the Lightning ``DeepSpeedStrategy`` keyword
argument that writes each one (so an error names what the user typed), and DeepSpeed's defaults for what a config
leaves out. :mod:`lightning_trainopt.parallel.spec` builds its :class:`StrategySpec` on these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.model_states import MODEL_SIZED_BUCKET_CAP, model_sized_bucket
from lightning_trainopt.planner.zero_infinity import check_optimizer_swap_buffers

__all__ = [
    "AUTO",
    "BUCKET_KEYS",
    "DEEPSPEED_DEFAULTS",
    "PLACES",
    "ZeroSpec",
    "check_deepspeed_kwargs",
    "config_key",
    "lightning_zero_config",
    "read_zero",
]

#: Where optimizer states or parameters live: DeepSpeed's ``offload_*.device`` vocabulary.
PLACES = ("none", "cpu", "nvme")
#: A preset's bucket size that the builder sizes to the model (:func:`model_sized_bucket`).
AUTO = "auto"
#: DeepSpeed bucket arguments a preset may set to ``auto``.
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size")

#: DeepSpeed's defaults for the ``zero_optimization`` keys a config leaves out (DeepSpeed 0.19,
#: ``runtime/zero/config.py`` ``DeepSpeedZeroConfig`` and ``runtime/zero/offload_config.py``; ``overlap_comm``
#: unset means "on for stage 3 only"). DeepSpeed is optional and importing it prints to stdout, so they are written
#: here once; ``tests/unit/parallel/test_spec.py`` compares each with DeepSpeed's own config classes.
DEEPSPEED_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "stage": 0,
        "contiguous_gradients": True,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
        "sub_group_size": 1_000_000_000,
        "param_persistence_threshold": 100_000,
        "prefetch_bucket_size": 50_000_000,
        "max_live_parameters": 1_000_000_000,
        "max_reuse_distance": 1_000_000_000,
        "offload_optimizer.device": "none",
        "offload_optimizer.buffer_count": 4,
        "offload_optimizer.ratio": 1.0,
        "offload_param.device": "none",
        "offload_param.buffer_count": 5,
        "offload_param.buffer_size": 100_000_000,
        "offload_param.max_in_cpu": 1_000_000_000,
    }
)


@dataclass(frozen=True)
class _Count:
    """A whole-number ZeRO setting: its :class:`ZeroSpec` field, its key in ``zero_optimization`` (dotted inside an
    offload block), DeepSpeed's alias for it, and the least value DeepSpeed accepts."""

    field: str
    path: str
    alias: str | None
    minimum: int


_COUNTS = (
    _Count("reduce_bucket_size", "reduce_bucket_size", None, 1),
    _Count("allgather_bucket_size", "allgather_bucket_size", None, 1),
    _Count("sub_group_size", "sub_group_size", None, 0),
    _Count("param_persistence_threshold", "param_persistence_threshold", "stage3_param_persistence_threshold", 0),
    _Count("prefetch_bucket_size", "prefetch_bucket_size", "stage3_prefetch_bucket_size", 0),
    _Count("max_live_parameters", "max_live_parameters", "stage3_max_live_parameters", 0),
    _Count("max_reuse_distance", "max_reuse_distance", "stage3_max_reuse_distance", 0),
    _Count("optimizer_buffer_count", "offload_optimizer.buffer_count", None, 1),
    _Count("params_buffer_count", "offload_param.buffer_count", None, 1),
    _Count("params_buffer_size", "offload_param.buffer_size", None, 1),
    _Count("max_in_cpu", "offload_param.max_in_cpu", None, 0),
)

# Lightning's DeepSpeedStrategy keyword arguments and the ``zero_optimization`` key each writes
# (``_create_default_config``); an offload block is written only when its switch (``offload_optimizer``,
# ``offload_parameters``) is on.
_ZERO_KWARGS = {
    "stage": "stage",
    "contiguous_gradients": "contiguous_gradients",
    "overlap_comm": "overlap_comm",
    "allgather_partitions": "allgather_partitions",
    "reduce_scatter": "reduce_scatter",
    "allgather_bucket_size": "allgather_bucket_size",
    "reduce_bucket_size": "reduce_bucket_size",
    "sub_group_size": "sub_group_size",
}
_OFFLOAD_KWARGS = {
    "offload_optimizer": (
        "offload_optimizer",
        {
            "device": "offload_optimizer_device",
            "nvme_path": "nvme_path",
            "buffer_count": "optimizer_buffer_count",
            "pin_memory": "pin_memory",
        },
    ),
    "offload_param": (
        "offload_parameters",
        {
            "device": "offload_params_device",
            "nvme_path": "nvme_path",
            "buffer_count": "params_buffer_count",
            "buffer_size": "params_buffer_size",
            "max_in_cpu": "max_in_cpu",
            "pin_memory": "pin_memory",
        },
    ),
}
# TrainOptDeepSpeedStrategy's own argument; it writes it into a ZeRO-3 config it builds (not into a user's JSON).
_PERSISTENCE_KWARG = "param_persistence_threshold"
# The keyword argument behind each ``zero_optimization`` key, to name what the user typed in an error.
_KWARG_OF = {
    **{path: kwarg for kwarg, path in _ZERO_KWARGS.items()},
    **{block: switch for block, (switch, _) in _OFFLOAD_KWARGS.items()},
    **{f"{block}.{k}": kwarg for block, (_, keys) in _OFFLOAD_KWARGS.items() for k, kwarg in keys.items()},
    "param_persistence_threshold": _PERSISTENCE_KWARG,
    "stage3_param_persistence_threshold": _PERSISTENCE_KWARG,
}


@dataclass(frozen=True)
class ZeroSpec:
    """DeepSpeed's ZeRO settings, every one filled in (from the node or JSON, else the applicable default).

    Args:
        stage: ZeRO stage 0-3 (0: DeepSpeed without ZeRO).
        overlap_comm: the reduce bucket is double-buffered to overlap communication.
        contiguous_gradients: gradients are copied into the reduce buckets.
        reduce_bucket_size: elements per gradient-reduction bucket, or ``auto`` (a preset's model-sized bucket).
        allgather_bucket_size: elements per all-gather bucket, or ``auto``.
        sub_group_size: ZeRO-3 optimizer sub-group, in partition elements.
        param_persistence_threshold: ZeRO-3 keeps parameters with fewer elements whole on every rank.
        prefetch_bucket_size: ZeRO-3 ``stage3_prefetch_bucket_size`` (elements).
        max_live_parameters: ZeRO-3 ``stage3_max_live_parameters``.
        max_reuse_distance: ZeRO-3 ``stage3_max_reuse_distance``.
        optimizer_buffer_count: pinned swap buffers of optimizer NVMe offload.
        params_buffer_count: pinned swap buffers of parameter NVMe offload.
        params_buffer_size: elements per parameter swap buffer.
        max_in_cpu: parameter elements NVMe parameter offload keeps in CPU memory.
        optimizer_nvme_path: the swap folder of optimizer states (``None`` unless they go to NVMe).
        params_nvme_path: the swap folder of parameters (``None`` unless they go to NVMe).
        offload_optimizer_ratio: the fraction of optimizer states offloaded (DeepSpeed's partial offload).
    """

    stage: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_bucket_size: int | Literal["auto"]
    allgather_bucket_size: int | Literal["auto"]
    sub_group_size: int
    param_persistence_threshold: int
    prefetch_bucket_size: int
    max_live_parameters: int
    max_reuse_distance: int
    optimizer_buffer_count: int
    params_buffer_count: int
    params_buffer_size: int
    max_in_cpu: int
    optimizer_nvme_path: str | None
    params_nvme_path: str | None
    offload_optimizer_ratio: float

    def with_buckets_for(self, n_params: int | None) -> ZeroSpec:
        """These settings with ``auto`` bucket sizes made numbers: :func:`model_sized_bucket` of ``n_params``
        (``None``: unknown, the cap of :data:`MODEL_SIZED_BUCKET_CAP` elements), as the builder runs them."""
        size = MODEL_SIZED_BUCKET_CAP if n_params is None else model_sized_bucket(n_params)
        sized: dict[str, Any] = {k: size for k in BUCKET_KEYS if getattr(self, k) == AUTO}
        return replace(self, **sized) if sized else self


def read_zero(config: Mapping[str, Any], *, from_json: bool, allow_auto: bool = False) -> tuple[ZeroSpec, str, str]:
    """``(ZeRO settings, optimizer offload device, parameter offload device)`` of a DeepSpeed config, with
    :data:`DEEPSPEED_DEFAULTS` for what it leaves out.

    Args:
        config: the config (a user's JSON, or the one Lightning builds from keyword arguments).
        from_json: errors name ``strategy.config.zero_optimization.<key>``; otherwise the keyword argument that
            writes the key (``strategy.<argument>``).
        allow_auto: bucket sizes may be ``auto`` (a preset's keyword arguments, before the builder sizes them).

    Raises:
        ConfigError: a value DeepSpeed would refuse deep inside engine set-up, or fewer optimizer swap buffers than
            ZeRO-Infinity's Adam takes, naming the key.
    """

    def key(path: str) -> str:
        return config_key(path, from_json)

    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError(key(""), zero, 'use a mapping such as {"stage": 2}.')
    stage = zero.get("stage", DEEPSPEED_DEFAULTS["stage"])
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(key("stage"), stage, "use ZeRO stage 0, 1, 2 or 3.")
    offload_optimizer = _offload_device(zero, "offload_optimizer", "cpu_offload", key)
    offload_params = _offload_device(zero, "offload_param", "cpu_offload_param", key)
    counts: dict[str, Any] = {}
    for count in _COUNTS:
        block, _, field_name = count.path.rpartition(".")
        values = (zero.get(block) if block else zero) or {}
        found = next((k for k in (count.alias, field_name) if k and k in values), None)
        if found is None:
            counts[count.field] = DEEPSPEED_DEFAULTS[count.path]
            continue
        where = f"{block}.{found}" if block else found
        value = values[found]
        if allow_auto and count.field in BUCKET_KEYS and value == AUTO:
            counts[count.field] = AUTO
            continue
        fix = _bucket_fix() if allow_auto and count.field in BUCKET_KEYS else None
        counts[count.field] = _whole(key(where), value, count.minimum, fix)
    if offload_optimizer == "nvme" and "buffer_count" in (zero.get("offload_optimizer") or {}):
        check_optimizer_swap_buffers(key("offload_optimizer.buffer_count"), counts["optimizer_buffer_count"])
    ratio = (zero.get("offload_optimizer") or {}).get("ratio", DEEPSPEED_DEFAULTS["offload_optimizer.ratio"])
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError(key("offload_optimizer.ratio"), ratio, "use a fraction between 0 and 1 (1: all of it).")
    overlap = zero.get("overlap_comm")
    settings = ZeroSpec(
        stage=int(stage),
        # DeepSpeed's validator: overlap_comm left unset is on for stage 3 only.
        overlap_comm=bool(stage == 3 if overlap is None else overlap),
        contiguous_gradients=bool(zero.get("contiguous_gradients", DEEPSPEED_DEFAULTS["contiguous_gradients"])),
        optimizer_nvme_path=_nvme_path(zero, "offload_optimizer", offload_optimizer),
        params_nvme_path=_nvme_path(zero, "offload_param", offload_params),
        offload_optimizer_ratio=float(ratio),
        **counts,
    )
    return settings, offload_optimizer, offload_params


def lightning_zero_config(args: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``zero_optimization`` block Lightning's ``DeepSpeedStrategy`` writes for these keyword arguments (the
    class's defaults with the node's values), and ``TrainOptDeepSpeedStrategy``'s ZeRO-3 persistence threshold when
    the class takes one; ``None`` with ``zero_optimization=False``."""
    if not args.get("zero_optimization", True):
        return None
    zero: dict[str, Any] = {path: args[kwarg] for kwarg, path in _ZERO_KWARGS.items() if kwarg in args}
    for block, (switch, keys) in _OFFLOAD_KWARGS.items():
        if args.get(switch):
            zero[block] = {k: args[kwarg] for k, kwarg in keys.items() if kwarg in args}
    if _PERSISTENCE_KWARG in args and zero.get("stage") == 3:
        zero["stage3_param_persistence_threshold"] = args[_PERSISTENCE_KWARG]
    return zero


def check_deepspeed_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse a bad keyword argument even where the preset does not use it (a count while offload is off)."""
    counts = {_KWARG_OF[c.path]: c for c in _COUNTS if c.path in _KWARG_OF}
    for kwarg, value in kwargs.items():
        if kwarg == "stage" and (isinstance(value, bool) or value not in (0, 1, 2, 3)):
            raise ConfigError("strategy.stage", value, "use ZeRO stage 0, 1, 2 or 3.")
        if kwarg in ("offload_optimizer_device", "offload_params_device") and value not in PLACES:
            raise ConfigError(f"strategy.{kwarg}", value, f"use one of {', '.join(PLACES)}.")
        count = counts.get(kwarg)
        if count is None or (count.field in BUCKET_KEYS and value == AUTO):
            continue
        _whole(f"strategy.{kwarg}", value, count.minimum, _bucket_fix() if count.field in BUCKET_KEYS else None)


def config_key(path: str, from_json: bool) -> str:
    """The key the user writes for ``zero_optimization.<path>`` (``offload_param.buffer_size``): the JSON path under
    ``strategy.config`` in a JSON, else the keyword argument that writes it (``strategy.params_buffer_size``)."""
    if from_json:
        return "strategy.config.zero_optimization" + (f".{path}" if path else "")
    return f"strategy.{_KWARG_OF.get(path, path or 'zero_optimization')}"


def _offload_device(zero: Mapping[str, Any], block: str, legacy: str, key: Callable[[str], str]) -> str:
    """``none``/``cpu``/``nvme`` of ``zero_optimization.<block>.device``."""
    node = zero.get(block)
    if node is None:
        # DeepSpeed still maps the deprecated booleans (cpu_offload, cpu_offload_param) onto the CPU.
        return "cpu" if zero.get(legacy) else "none"
    if not isinstance(node, Mapping):
        raise ConfigError(key(block), node, 'use a mapping such as {"device": "cpu"}.')
    device = str(node.get("device", DEEPSPEED_DEFAULTS[f"{block}.device"]))
    if device not in PLACES:
        raise ConfigError(key(f"{block}.device"), device, f"use one of {', '.join(PLACES)}.")
    return device


def _nvme_path(zero: Mapping[str, Any], block: str, device: str) -> str | None:
    if device != "nvme":
        return None
    path = (zero.get(block) or {}).get("nvme_path")
    return None if path is None else str(path)


def _whole(key: str, value: Any, minimum: int, fix: str | None = None) -> int:
    """``value`` as an int >= ``minimum``; integral floats (``5e8`` in a JSON) pass, fractions and text do not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
        raise ConfigError(key, value, fix or f"use a whole number >= {minimum}.")
    return int(value)


def _bucket_fix() -> str:
    return (
        f"use a positive whole number of elements, or auto (the model's parameter count, at most "
        f"{MODEL_SIZED_BUCKET_CAP:,})."
    )
