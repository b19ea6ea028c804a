"""What a strategy node means, worked out once: :class:`StrategySpec`, from a preset node or a DeepSpeed JSON.

A ``conf/strategy`` node (its ``_target_`` and keyword arguments, with the user's overrides) or a DeepSpeed JSON
(``strategy.config``) is read here and nowhere else (``config/strategy.py`` hands it over as plain values): the
builder, the strategies, the pre-flight checks, the callbacks and the planner all take a :class:`StrategySpec`, and
ask it what the strategy does (``spec.shards_params``, ``spec.offloads_optimizer``; the questions of
:class:`~lightning_trainopt.planner.strategy_layout.StrategyQuestions`) instead of testing its kind.

Why the spec lives here and the planner reads a view of it: telling a strategy's kind means importing Lightning's
strategy classes, which the pure planner (a lower layer) may not do, while the planner's figures need the spec on a
given world size (no ``+strategy`` is one device or DDP). So the spec stays in ``parallel/`` beside the code that
builds strategies, its questions are defined once in the pure ``planner/strategy_layout.py`` (inherited by both), and
:meth:`StrategySpec.layout` is the one function that makes the planner's
:class:`~lightning_trainopt.planner.strategy_layout.StrategyLayout`. ``ZeroSpec`` is not a second description: it is
the DeepSpeed part of a spec (its ``zero`` field). What a node leaves out gets the default of whoever applies it:

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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.deepspeed_json import load_deepspeed_json
from lightning_trainopt.parallel.zero_spec import (
    AUTO,
    BUCKET_KEYS,
    DEEPSPEED_DEFAULTS,
    PLACES,
    ZeroSpec,
    check_deepspeed_kwargs,
    config_key,
    lightning_zero_config,
    read_zero,
)
from lightning_trainopt.planner.strategy_layout import StrategyLayout, StrategyQuestions

if TYPE_CHECKING:
    from lightning_trainopt.parallel.compat_table import Family
    from lightning_trainopt.precision.plugins import PrecisionNeeds

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
    "precision_needs",
    "resolve_target",
    "spec_of",
    "with_spec",
]

#: ``none`` (no ``+strategy``: Lightning picks), ``ddp``, ``deepspeed``, ``fsdp`` (FSDP2, or FSDP1 by
#: ``fsdp_version``), ``other`` (a Strategy this project does not interpret; the planner refuses it).
KINDS = ("none", "ddp", "deepspeed", "fsdp", "other")


@dataclass(frozen=True)
class StrategySpec(StrategyQuestions):
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

        spec = parse_strategy(OmegaConf.load("lightning_trainopt/conf/strategy/zero3_offload.yaml"))
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
        return config_key(path, self.from_json)

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

    @property
    def package(self) -> str | None:
        """The optional package (and pip extra) the strategy needs: ``deepspeed``, else ``None``."""
        return "deepspeed" if self.kind == "deepspeed" else None

    @property
    def chosen(self) -> bool:
        """The run names a strategy (``+strategy=...``); without one, Lightning picks."""
        return self.kind != "none"

    @property
    def family(self) -> Family | None:
        """Its column in the technique x strategy table (``parallel/compat_table.py``): ``single``, ``ddp``,
        ``zero12``, ``zero3``, ``fsdp2`` or ``fsdp1``; ``None`` for a strategy class the table does not know."""
        return self.family_at()

    def family_at(self, tensor_parallel: int = 1, data_parallel: int = 1) -> Family | None:
        """Its column at a tensor-parallel and data-parallel size: FSDP2's class with ``tensor_parallel > 1`` is the
        ``tp`` column (no data parallelism) or ``fsdp_tp``."""
        from lightning_trainopt.parallel.compat_table import family_of

        return family_of(self.kind, self.zero_stage, self.fsdp_version, tensor_parallel, data_parallel)

    @property
    def precision_needs(self) -> PrecisionNeeds:
        """What this strategy needs of its Lightning precision plugin, as plain answers for ``precision/``."""
        from lightning_trainopt.precision.plugins import PrecisionNeeds

        return PrecisionNeeds(
            strategy=self.name,
            engine_precision=self.wraps_in_engine,
            sharded_scaler=self.kind == "fsdp" and self.fsdp_version == 1,
            per_param_shards=self.kind == "fsdp" and self.fsdp_version != 1,
        )

    def layout(self, world_size: int) -> StrategyLayout:
        """The planner's view of this strategy on ``world_size`` devices: the one place a
        :class:`~lightning_trainopt.planner.strategy_layout.StrategyLayout` is made from a spec.

        Without a strategy, Lightning's default: DDP on more than one device, else a single device. A DDP preset
        stays DDP on one device too (Lightning wraps the model in DDP whatever the world).

        Raises:
            ConfigError: ZeRO stage 0, a partial optimizer offload (``ratio``), or a kind the planner does not model,
                naming the key as the user wrote it.
        """
        if self.kind == "none":
            kind = "ddp" if world_size > 1 else "single"
            return StrategyLayout(name=kind, kind=kind)
        if self.kind == "ddp":
            return StrategyLayout(name=self.name, kind="ddp")
        if self.kind == "fsdp":
            return StrategyLayout(
                name=self.name,
                kind="fsdp",
                offload_params=self.offload_params,
                offload_optimizer=self.offload_optimizer,
                # FSDP1's class has no such argument (None): it reshards after forward, as FSDP2's default does.
                reshard_after_forward=self.reshard_after_forward is not False,
            )
        if self.kind != "deepspeed" or self.zero is None:
            raise ConfigError(
                "strategy._target_", self.target, "the planner models ddp, zero1/2/3 (+offload, infinity) and fsdp."
            )
        zero = self.zero
        if zero.stage == 0:
            where = "in the JSON" if self.from_json else "with strategy.stage=1, 2 or 3"
            raise ConfigError(
                self.key("stage"),
                0,
                f"the planner models ZeRO stages 1, 2 and 3 (0 is no ZeRO); set the stage {where}.",
            )
        if zero.offload_optimizer_ratio != 1.0:
            raise ConfigError(
                self.key("offload_optimizer.ratio"),
                zero.offload_optimizer_ratio,
                "the planner models whole offload only; remove ratio (or set 1.0) to plan the run.",
            )
        return StrategyLayout(
            name=self.name,
            kind="deepspeed",
            zero_stage=zero.stage,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
            # `auto` (the ZeRO-1/2 presets): the cap here; the model's parameter count, at most the cap, is planned
            # (StrategyLayout.bucket_numel), as the builder runs it.
            reduce_bucket_size=int(zero.with_buckets_for(None).reduce_bucket_size),
            buckets_sized_to_model=zero.reduce_bucket_size == AUTO,
            param_persistence_threshold=zero.param_persistence_threshold,
            overlap_comm=zero.overlap_comm,
            contiguous_gradients=zero.contiguous_gradients,
            prefetch_bucket_size=zero.prefetch_bucket_size,
            max_live_parameters=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            sub_group_size=zero.sub_group_size,
            optimizer_buffer_count=zero.optimizer_buffer_count,
            params_buffer_count=zero.params_buffer_count,
            params_buffer_size=zero.params_buffer_size,
            max_in_cpu=zero.max_in_cpu,
        )


def parse_strategy(node: Mapping[str, Any] | None) -> StrategySpec:
    """The :class:`StrategySpec` of a ``strategy`` node: a ``conf/strategy`` preset with the user's overrides.

    The node's ``_target_`` class is imported to tell its kind (by subclass of Lightning's strategies) and to read
    the defaults of what the node leaves out. A DeepSpeed node with ``config`` (a JSON path or mapping) is read from
    that JSON, as Lightning does, and its keyword arguments are ignored.

    Args:
        node: the ``strategy`` node as a plain mapping (``config/strategy.py`` reads it from the composed config), or
            ``None`` when there is no ``+strategy``.

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
    cls = resolve_target(target)
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
    zero, offload_optimizer, offload_params = read_zero(config, from_json=from_json, allow_auto=allow_auto)
    kept = MappingProxyType(copy.deepcopy(dict(config))) if from_json else None
    return StrategySpec(
        name=name,
        kind="deepspeed",
        target=target,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        zero=zero,
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
    kind, version = _kind(cls)
    return StrategySpec(name=name, kind=kind, target=target, fsdp_version=version)


def precision_needs(strategy: Any) -> PrecisionNeeds:
    """What ``strategy`` (a built Lightning strategy, or ``"auto"`` and other names Lightning resolves to one device
    or DDP) needs of its precision plugin: the argument ``precision.trainer_precision_kwargs`` takes."""
    from lightning_trainopt.precision.plugins import PrecisionNeeds

    return PrecisionNeeds(strategy=strategy) if isinstance(strategy, str) else spec_of(strategy).precision_needs


def with_spec(strategy: Any, spec: StrategySpec | None = None) -> Any:
    """``strategy`` carrying its :class:`StrategySpec` as ``strategy.spec``, and returned.

    The rooms below ``parallel/`` (the LightningModules' build dtype, ZeRO-3's partitioned weight loading, the fused
    optimizer choice) read a strategy's answers from ``trainer.strategy.spec`` and never test its class. Our
    strategies carry their spec from ``__init__``; the app's builder gives one to any other class it builds, and a
    user who trains our modules under one of Lightning's own strategies passes it through this function::

        Trainer(strategy=with_spec(DeepSpeedStrategy(stage=3)))

    Args:
        strategy: a built strategy.
        spec: its spec when known (the node it was built from); default :func:`spec_of` the strategy.
    """
    if not isinstance(getattr(strategy, "spec", None), StrategySpec):
        strategy.spec = spec if spec is not None else spec_of(strategy)
    return strategy


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


def resolve_target(target: str) -> Any:
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
    check_deepspeed_kwargs(kwargs)
    zero = lightning_zero_config(args)
    config_of_kwargs = {} if zero is None else {"zero_optimization": zero}
    return deepspeed_config_spec(config_of_kwargs, name=name, target=target, from_json=False, allow_auto=True)
