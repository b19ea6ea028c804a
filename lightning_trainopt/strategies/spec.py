"""What a strategy node means, worked out once: :class:`StrategySpec`, from a preset node or a DeepSpeed JSON.

A ``conf/strategy`` node (its ``_target_`` and keyword arguments, with the user's overrides) or a DeepSpeed JSON
(``strategy.config``) is read here and nowhere else: the builder, the strategies, the pre-flight checks and the
planner all take a :class:`StrategySpec`. What a node leaves out gets the default of whoever applies it:

* a keyword argument, the default in the signature of the ``_target_`` class (Lightning's ``DeepSpeedStrategy``,
  ``TrainOptDeepSpeedStrategy``, ``TrainOptFSDPStrategy``, ...), read with :func:`class_defaults`;
* a key of a DeepSpeed config (a user's JSON, or one of DeepSpeed's own settings no keyword argument reaches, such
  as ``stage3_prefetch_bucket_size``), DeepSpeed's default: :data:`DEEPSPEED_DEFAULTS`.

Keyword arguments are read as Lightning turns them into DeepSpeed's config (``DeepSpeedStrategy
._create_default_config``), so a preset and the JSON it stands for give equal specs. Nothing here imports Lightning
at import time; reading a class's defaults imports that class.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from lightning_trainopt.core.estimate.model_states import MODEL_SIZED_BUCKET_CAP, model_sized_bucket
from lightning_trainopt.core.estimate.zero_infinity import check_optimizer_swap_buffers
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.strategies.deepspeed_json import load_deepspeed_json

__all__ = [
    "AUTO",
    "BUCKET_KEYS",
    "DEEPSPEED_DEFAULTS",
    "KINDS",
    "PLACES",
    "StrategySpec",
    "ZeroSpec",
    "class_defaults",
    "deepspeed_config_spec",
    "fsdp_spec",
    "parse_strategy",
    "spec_of",
]

#: ``none`` (no ``+strategy``: Lightning picks), ``ddp``, ``deepspeed``, ``fsdp`` (FSDP2, or FSDP1 by
#: ``fsdp_version``), ``other`` (a Strategy this project does not interpret; the planner refuses it).
KINDS = ("none", "ddp", "deepspeed", "fsdp", "other")
#: Where optimizer states or parameters live: DeepSpeed's ``offload_*.device`` vocabulary.
PLACES = ("none", "cpu", "nvme")
#: A preset's bucket size that the builder sizes to the model (:func:`model_sized_bucket`).
AUTO = "auto"
#: DeepSpeed bucket arguments a preset may set to ``auto``.
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size")

#: DeepSpeed's defaults for the ``zero_optimization`` keys a config leaves out (DeepSpeed 0.19,
#: ``runtime/zero/config.py`` ``DeepSpeedZeroConfig`` and ``runtime/zero/offload_config.py``; ``overlap_comm``
#: unset means "on for stage 3 only"). DeepSpeed is optional and importing it prints to stdout, so they are written
#: here once; ``tests/unit/strategies/test_spec.py`` compares each with DeepSpeed's own config classes.
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


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy node means, as plain data: parse one with :func:`parse_strategy`.

    Args:
        name: what metrics.json calls it: the node's ``name`` or ``preset`` (``zero3``), else the class name in
            lower case without ``Strategy`` (``ddp``); ``auto`` without a strategy.
        kind: one of :data:`KINDS`.
        target: the ``_target_`` it was parsed from (empty without a strategy).
        offload_optimizer: where optimizer states live, one of :data:`PLACES`.
        offload_params: where parameters live, one of :data:`PLACES`.
        zero: the ZeRO settings of a DeepSpeed strategy (``None`` for every other kind).
        fsdp_version: 2 for FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``), 1 for Lightning's
            ``FSDPStrategy``; ``None`` for other kinds.
        reshard_after_forward: FSDP2 frees gathered parameters after forward (``None`` where the class has no such
            argument).
        config: the user's DeepSpeed JSON as loaded (read-only), when the settings came from one; not compared.

    Example::

        spec = parse_strategy(OmegaConf.load("conf/strategy/zero3_offload.yaml"))
        spec.zero.stage, spec.offload  # (3, {"optimizer": "cpu", "param": "cpu"})
    """

    name: str
    kind: str
    target: str = ""
    offload_optimizer: str = "none"
    offload_params: str = "none"
    zero: ZeroSpec | None = None
    fsdp_version: int | None = None
    reshard_after_forward: bool | None = None
    config: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StrategySpec.kind must be one of {KINDS}, not {self.kind!r}")

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (0 when this is not DeepSpeed, or DeepSpeed without ZeRO)."""
        return self.zero.stage if self.zero is not None else 0

    @property
    def offload(self) -> dict[str, str]:
        """``{"optimizer": ..., "param": ...}``, as metrics.json ``offload`` and the engine report it."""
        return {"optimizer": self.offload_optimizer, "param": self.offload_params}

    @property
    def offload_by_category(self) -> dict[str, str]:
        """The same places keyed by memory category (``params``, ``optimizer_states``), as ``memory_breakdown``
        takes them."""
        return {"params": self.offload_params, "optimizer_states": self.offload_optimizer}

    @property
    def from_json(self) -> bool:
        """The settings come from a DeepSpeed JSON (``strategy.config``), not from keyword arguments."""
        return self.config is not None

    @property
    def json_optimizer(self) -> bool:
        """The DeepSpeed JSON has its own ``optimizer`` block (DeepSpeed then builds the optimizer)."""
        return self.config is not None and "optimizer" in self.config

    def key(self, path: str) -> str:
        """The config key the user writes for ``zero_optimization.<path>`` (``offload_param.buffer_size``):
        ``strategy.params_buffer_size`` in a preset, the JSON path under ``strategy.config`` in a JSON."""
        return _json_key(path) if self.from_json else _kwarg_key(path)

    def nvme_swaps(self) -> list[tuple[str, str, str | None]]:
        """``(what, config key, swap folder)`` of each offload that goes to NVMe; ``what`` is ``optimizer`` or
        ``param`` (the keys of :attr:`offload`)."""
        if self.zero is None:
            return []
        swaps: list[tuple[str, str, str | None]] = []
        if self.offload_optimizer == "nvme":
            swaps.append(("optimizer", self.key("offload_optimizer.nvme_path"), self.zero.optimizer_nvme_path))
        if self.offload_params == "nvme":
            swaps.append(("param", self.key("offload_param.nvme_path"), self.zero.params_nvme_path))
        return swaps

    def with_buckets_for(self, n_params: int | None) -> StrategySpec:
        """This spec with ``auto`` bucket sizes made numbers (:meth:`ZeroSpec.with_buckets_for`)."""
        return self if self.zero is None else replace(self, zero=self.zero.with_buckets_for(n_params))


def parse_strategy(node: Mapping[str, Any] | None) -> StrategySpec:
    """The :class:`StrategySpec` of a ``strategy`` node: a ``conf/strategy`` preset with the user's overrides.

    The node's ``_target_`` class is imported to tell its kind (by subclass of Lightning's strategies) and to read
    the defaults of what the node leaves out. A DeepSpeed node with ``config`` (a JSON path or mapping) is read from
    that JSON, as Lightning does, and its keyword arguments are ignored.

    Args:
        node: the ``strategy`` node (a ``DictConfig`` or a mapping), or ``None`` when there is no ``+strategy``.

    Raises:
        ConfigError: a missing (``???``) value, no or no importable ``_target_``, an unreadable JSON, or a bad
            value, naming the key as the user wrote it (``strategy.sub_group_size`` or
            ``strategy.config.zero_optimization.sub_group_size``).
    """
    plain = _plain(node)
    if not plain:
        return StrategySpec(name="auto", kind="none")
    for key, value in plain.items():
        if isinstance(value, str) and value == "???":
            raise ConfigError(f"strategy.{key}", "???", f"this preset needs it: add strategy.{key}=... to the command.")
    target = plain.get("_target_")
    if not target:
        raise ConfigError("strategy._target_", target, "pick a preset with +strategy=NAME (see conf/strategy/).")
    target = str(target)
    cls = _resolve(target)
    kwargs = {str(k): v for k, v in plain.items() if not str(k).startswith("_") and k != "name"}
    name = _name(plain, kwargs, cls, target)
    kind, version = _kind(cls)
    if kind == "deepspeed":
        return _deepspeed_node(name, target, cls, kwargs)
    if kind == "fsdp":
        args = {**class_defaults(cls), **kwargs}
        return fsdp_spec(name, target, args.get("cpu_offload"), args.get("reshard_after_forward"), version)
    return StrategySpec(name=name, kind=kind, target=target)


def deepspeed_config_spec(
    config: Mapping[str, Any], *, name: str, target: str, from_json: bool, allow_auto: bool = False
) -> StrategySpec:
    """The spec of a DeepSpeed config as DeepSpeed reads it, with :data:`DEEPSPEED_DEFAULTS` for what it leaves out.

    Args:
        config: the config (a user's JSON, or the one Lightning built from keyword arguments).
        name: the preset name.
        target: the strategy class's ``_target_``.
        from_json: the config is the user's JSON: errors name ``strategy.config.zero_optimization.<key>`` and the
            spec keeps a read-only copy; otherwise they name the keyword argument (``strategy.<argument>``).
        allow_auto: bucket sizes may be ``auto`` (a preset's keyword arguments, before the builder sizes them).

    Raises:
        ConfigError: a value DeepSpeed would refuse deep inside engine set-up, or fewer optimizer swap buffers than
            ZeRO-Infinity's Adam takes, naming the key.
    """
    key = _json_key if from_json else _kwarg_key
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
    spec = ZeroSpec(
        stage=int(stage),
        # DeepSpeed's validator: overlap_comm left unset is on for stage 3 only.
        overlap_comm=bool(stage == 3 if overlap is None else overlap),
        contiguous_gradients=bool(zero.get("contiguous_gradients", DEEPSPEED_DEFAULTS["contiguous_gradients"])),
        optimizer_nvme_path=_nvme_path(zero, "offload_optimizer", offload_optimizer),
        params_nvme_path=_nvme_path(zero, "offload_param", offload_params),
        offload_optimizer_ratio=float(ratio),
        **counts,
    )
    kept = MappingProxyType(copy.deepcopy(dict(config))) if from_json else None
    return StrategySpec(
        name=name,
        kind="deepspeed",
        target=target,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        zero=spec,
        config=kept,
    )


def fsdp_spec(
    name: str, target: str, cpu_offload: Any, reshard_after_forward: Any = None, version: int | None = 2
) -> StrategySpec:
    """The spec of an FSDP strategy: ``cpu_offload`` (a bool, or FSDP1's ``CPUOffload(offload_params=...)`` as an
    object or a mapping) keeps parameters, gradients and optimizer states on the CPU."""
    if isinstance(cpu_offload, Mapping):
        offloaded = bool(cpu_offload.get("offload_params", False))
    elif cpu_offload is None or isinstance(cpu_offload, bool):
        offloaded = bool(cpu_offload)
    else:
        offloaded = bool(getattr(cpu_offload, "offload_params", True))
    place = "cpu" if offloaded else "none"
    return StrategySpec(
        name=name,
        kind="fsdp",
        target=target,
        offload_optimizer=place,
        offload_params=place,
        fsdp_version=version,
        reshard_after_forward=None if reshard_after_forward is None else bool(reshard_after_forward),
    )


def spec_of(strategy: Any) -> StrategySpec:
    """The spec of a built strategy: its own ``spec`` (ours), a DeepSpeed ``config`` dict (e.g. Lightning's
    ``DeepSpeedStrategy`` built by a user), else its kind with nothing offloaded."""
    own = getattr(strategy, "spec", None)
    if isinstance(own, StrategySpec):
        return own
    cls = type(strategy)
    target = f"{cls.__module__}.{cls.__qualname__}"
    name = cls.__name__.removesuffix("Strategy").lower()
    config = getattr(strategy, "config", None)
    if isinstance(config, Mapping):
        return deepspeed_config_spec(config, name=name, target=target, from_json=True)
    return StrategySpec(name=name, kind=_kind(cls)[0], target=target)


@functools.cache
def class_defaults(cls: type) -> Mapping[str, Any]:
    """The keyword defaults of ``cls.__init__``, and of each parent ``__init__`` its ``**kwargs`` are passed on to.

    The walk up the class's MRO stops at the first ``__init__`` without ``**kwargs``; the class's own default wins.
    """
    defaults: dict[str, Any] = {}
    for klass in getattr(cls, "__mro__", ()):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        forwards = False
        for param in inspect.signature(init).parameters.values():
            if param.kind is param.VAR_KEYWORD:
                forwards = True
            elif param.default is not param.empty:
                defaults.setdefault(param.name, param.default)
        if not forwards:
            break
    return MappingProxyType(defaults)


def _plain(node: Any) -> dict[str, Any] | None:
    if node is None:
        return None
    from omegaconf import OmegaConf

    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise ConfigError("strategy", node, "use a strategy preset: +strategy=NAME (see conf/strategy/).")
    return dict(node)


def _name(plain: Mapping[str, Any], kwargs: Mapping[str, Any], cls: Any, target: str) -> str:
    """What metrics.json and messages call the strategy: the node's ``name``, else its ``preset`` argument (or the
    class's default one), else the class name in lower case without ``Strategy`` (``ddp`` for ``DDPStrategy``)."""
    if plain.get("name"):
        return str(plain["name"])
    preset = kwargs.get("preset", class_defaults(cls).get("preset") if isinstance(cls, type) else None)
    if preset:
        return str(preset)
    return target.rsplit(".", 1)[-1].removesuffix("Strategy").lower()


def _resolve(target: str) -> Any:
    """The object a ``_target_`` names, imported as Hydra's ``instantiate`` would."""
    module, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            "strategy._target_",
            target,
            f"it does not import ({err}); point it at a Strategy class, or pick a preset with +strategy=NAME "
            "(see conf/strategy/).",
        ) from None


def _kind(cls: Any) -> tuple[str, int | None]:
    """``(kind, fsdp_version)`` of a strategy class, by which of Lightning's strategies it derives from."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if not isinstance(cls, type):
        return "other", None
    if issubclass(cls, DeepSpeedStrategy):  # a DDPStrategy too: ask first
        return "deepspeed", None
    if issubclass(cls, ModelParallelStrategy):
        return "fsdp", 2
    if issubclass(cls, FSDPStrategy):
        return "fsdp", 1
    if issubclass(cls, DDPStrategy):
        return "ddp", None
    return "other", None


def _deepspeed_node(name: str, target: str, cls: type, kwargs: dict[str, Any]) -> StrategySpec:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    defaults = {**class_defaults(DeepSpeedStrategy), **class_defaults(cls)}
    args = {**defaults, **kwargs}
    config = args.get("config")
    if config is not None:
        if isinstance(config, Mapping):
            user = dict(config)
        elif isinstance(config, str):
            user = load_deepspeed_json(config)
        else:
            raise ConfigError("strategy.config", config, "give the path of a DeepSpeed JSON file.")
        return deepspeed_config_spec(user, name=name, target=target, from_json=True)
    _check_kwargs(kwargs)
    zero = _zero_config_of(args, persistence=_PERSISTENCE_KWARG in defaults)
    config_of_kwargs = {} if zero is None else {"zero_optimization": zero}
    return deepspeed_config_spec(config_of_kwargs, name=name, target=target, from_json=False, allow_auto=True)


def _zero_config_of(args: Mapping[str, Any], persistence: bool) -> dict[str, Any] | None:
    """The ``zero_optimization`` block Lightning's ``DeepSpeedStrategy`` writes for these keyword arguments (and
    ``TrainOptDeepSpeedStrategy``'s ZeRO-3 persistence threshold), or ``None`` with ``zero_optimization=False``."""
    if not args.get("zero_optimization", True):
        return None
    zero: dict[str, Any] = {path: args[kwarg] for kwarg, path in _ZERO_KWARGS.items() if kwarg in args}
    for block, (switch, keys) in _OFFLOAD_KWARGS.items():
        if args.get(switch):
            zero[block] = {k: args[kwarg] for k, kwarg in keys.items() if kwarg in args}
    if persistence and zero.get("stage") == 3:
        zero["stage3_param_persistence_threshold"] = args[_PERSISTENCE_KWARG]
    return zero


def _check_kwargs(kwargs: Mapping[str, Any]) -> None:
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


def _json_key(path: str) -> str:
    return "strategy.config.zero_optimization" + (f".{path}" if path else "")


def _kwarg_key(path: str) -> str:
    return f"strategy.{_KWARG_OF.get(path, path or 'zero_optimization')}"
