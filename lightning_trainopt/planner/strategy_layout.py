"""What the planner knows about a strategy, as plain data: :class:`StrategyLayout`, the questions every strategy
description answers (:class:`StrategyQuestions`) and the ``auto`` bucket rule.

One strategy is described once, by ``parallel.spec.StrategySpec`` (read from the ``strategy`` node in ``config/``).
The planner is pure and sits below ``parallel/``, so it cannot import that class (it imports Lightning to tell a
strategy's kind); :class:`StrategyLayout` is the planner's view of a spec on a given world size, made by one
function, ``StrategySpec.layout``, and nowhere else outside tests. The questions live here, low enough for both:
``StrategySpec`` and :class:`StrategyLayout` inherit them, so the spec and the planner answer "does it shard the
parameters?" with one definition, and callers ask (``spec.shards_params``) instead of testing a kind or a stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_trainopt import strategy_answers
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError

__all__ = [
    "MODEL_SIZED_BUCKET_CAP",
    "StrategyLayout",
    "StrategyQuestions",
    "model_sized_bucket",
    "registered_answers",
]

_KINDS = ("single", "ddp", "fsdp", "deepspeed")
_PLACES = ("none", "cpu", "nvme")
#: Largest DeepSpeed bucket, in elements, of a preset whose bucket sizes are ``auto`` (Lightning's default 2e8
#: allocates 0.8 GB of fp32 per rank up front).
MODEL_SIZED_BUCKET_CAP = 50_000_000


def model_sized_bucket(n_params: int, cap: int = MODEL_SIZED_BUCKET_CAP) -> int:
    """Elements of an ``auto`` DeepSpeed bucket: the model's parameter count, at most ``cap``.

    A bucket holds gradients (reduce) or parameters (all-gather) of the model, so one larger than the model is
    allocated and never filled; a 0.8M-parameter model would otherwise carry two 5e7-element reduce buffers.
    """
    return max(1, min(int(cap), int(n_params)))


class StrategyQuestions:
    """What a strategy does, asked instead of testing its kind or ZeRO stage.

    Answered from four attributes the inheriting dataclass has: ``kind`` (``ddp``, ``fsdp``, ``deepspeed``; any other
    kind shards and offloads nothing), ``zero_stage`` (0-3; DeepSpeed only), ``offload_optimizer`` and
    ``offload_params`` (``none``, ``cpu``, ``nvme``).
    """

    kind: str
    offload_optimizer: str
    offload_params: str
    if TYPE_CHECKING:  # a field of StrategyLayout, a property of StrategySpec: declared for the type checker only

        @property
        def zero_stage(self) -> int: ...

    @property
    def shards_optimizer(self) -> bool:
        """Each rank keeps 1/world of the optimizer states (FSDP, ZeRO-1/2/3)."""
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage >= 1)

    @property
    def shards_grads(self) -> bool:
        """Each rank keeps 1/world of the gradients after reduction (FSDP, ZeRO-2/3)."""
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage >= 2)

    @property
    def shards_params(self) -> bool:
        """Each rank keeps 1/world of the parameters (FSDP, ZeRO-3)."""
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage == 3)

    @property
    def gathers_for_forward(self) -> bool:
        """Parameters are all-gathered unit by unit for forward (and again for backward): they are sharded."""
        return self.shards_params

    @property
    def reduces_at_boundary(self) -> bool:
        """Gradients are reduced (and ``.grad`` freed) only at the accumulation boundary, so whole half-precision
        gradients accumulate between boundaries (ZeRO-1); every other sharding reduces each micro-batch."""
        return self.shards_optimizer and not self.shards_grads

    @property
    def offloads_optimizer(self) -> bool:
        """Optimizer states (and the fp32 master weights) live on the CPU or NVMe."""
        return self.offload_optimizer != "none"

    @property
    def offloads_params(self) -> bool:
        """Parameters live on the CPU or NVMe between uses."""
        return self.offload_params != "none"

    @property
    def offloads_to_nvme(self) -> bool:
        """Optimizer states or parameters swap to NVMe (ZeRO-Infinity)."""
        return "nvme" in (self.offload_optimizer, self.offload_params)

    @property
    def flat_partitions(self) -> bool:
        """The engine flattens the parameters of each group into one buffer and partitions that (DeepSpeed ZeRO);
        FSDP2 shards each parameter instead (:attr:`shards_each_param`)."""
        return self.kind == "deepspeed" and self.zero_stage >= 1

    @property
    def shards_each_param(self) -> bool:
        """Each parameter is its own sharded tensor (FSDP2 DTensors, FSDP1 flat units per module)."""
        return self.kind == "fsdp"

    @property
    def ddp_buckets(self) -> bool:
        """DDP wraps the model and allocates gradient buckets as large as the model, on any world size."""
        return self.kind == "ddp"

    @property
    def wraps_in_engine(self) -> bool:
        """The model is handed to an engine (DeepSpeed) that owns its training step: Lightning gives it a
        half-precision module for ``-mixed`` as for ``-true`` (nothing autocasts), and the engine scales the loss,
        fixes gradient accumulation at start-up and steps the optimizer."""
        return self.kind == "deepspeed"

    @property
    def builds_partitioned(self) -> bool:
        """The model's parameters are created already partitioned while it is built (DeepSpeed ZeRO-3's
        ``zero.Init``): weights must be copied in one gathered parameter at a time, and the build dtype is the
        engine's."""
        return self.wraps_in_engine and self.shards_params

    @property
    def own_precision_plugin(self) -> bool:
        """The strategy needs its own Lightning precision plugin (DeepSpeedPrecision, FSDPPrecision)."""
        return self.kind in ("deepspeed", "fsdp")

    @property
    def steps_cpu_adam(self) -> bool:
        """The optimizer steps on the CPU in DeepSpeed's CPU Adam (ZeRO-Offload), not the client optimizer."""
        return self.wraps_in_engine and self.offloads_optimizer


@dataclass(frozen=True)
class StrategyLayout(StrategyQuestions):
    """What the planner needs to know about a strategy (plain data, built from ``cfg.strategy``).

    Args:
        name: preset name for reports (``zero2``, ``ddp``, ...).
        kind: ``single`` (one device), ``ddp``, ``fsdp`` (FSDP2) or ``deepspeed``.
        zero_stage: 1, 2 or 3 for DeepSpeed; 0 otherwise.
        offload_optimizer: ``none``, ``cpu`` or ``nvme`` (optimizer states, master weights, fp32 gradients).
        offload_params: ``none``, ``cpu`` or ``nvme`` (ZeRO-3 and FSDP only).
        reduce_bucket_size: DeepSpeed gradient-reduction bucket, in elements (Lightning's default 2e8).
        param_persistence_threshold: ZeRO-3 keeps parameters of at most this many elements gathered on every rank (1e5).
        overlap_comm: DeepSpeed double-buffers its reduce bucket (Lightning's default ``True``).
        contiguous_gradients: DeepSpeed copies gradients into reduce buckets (Lightning's default ``True``).
        prefetch_bucket_size: ZeRO-3 ``stage3_prefetch_bucket_size`` (DeepSpeed default 5e7 elements).
        max_live_parameters: ZeRO-3 ``stage3_max_live_parameters`` (default 1e9).
        max_reuse_distance: ZeRO-3 ``stage3_max_reuse_distance`` (default 1e9).
        sub_group_size: ZeRO-3 optimizer sub-group, in partition elements (Lightning's default 1e12: one per param
            group; DeepSpeed's own 1e9).
        optimizer_buffer_count: pinned fp32 swap buffers of optimizer NVMe offload (Lightning's default 4).
        params_buffer_count: pinned swap buffers of parameter NVMe offload (Lightning's default 5).
        params_buffer_size: elements per parameter swap buffer (Lightning's default 1e8).
        max_in_cpu: parameter partition elements NVMe parameter offload keeps in CPU memory (default 1e9).
        buckets_sized_to_model: the preset's bucket size is ``auto``: ``reduce_bucket_size`` is then the cap and
            the bucket :func:`model_sized_bucket` of the model's parameter count, as the strategy builder runs it.
        reshard_after_forward: FSDP2 units free their gathered parameters after forward (the presets' ``true``).

    Example::

        StrategyLayout(name="zero2", kind="deepspeed", zero_stage=2)
    """

    name: str = "auto"
    kind: str = "single"
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_params: str = "none"
    reduce_bucket_size: int = 200_000_000
    param_persistence_threshold: int = 100_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000_000
    optimizer_buffer_count: int = 4
    params_buffer_count: int = 5
    params_buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    buckets_sized_to_model: bool = False
    reshard_after_forward: bool = True

    @property
    def label(self) -> str:
        """Its kind as the plan's header prints it: ``ddp``, ``fsdp``, ``deepspeed, ZeRO-3``."""
        return f"{self.kind}, ZeRO-{self.zero_stage}" if self.zero_stage else self.kind

    def bucket_numel(self, n_params: int) -> int:
        """Elements of the reduce bucket DeepSpeed allocates for a model of ``n_params`` parameters."""
        if self.buckets_sized_to_model:
            return model_sized_bucket(n_params, self.reduce_bucket_size)
        return self.reduce_bucket_size

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError("strategy.kind", self.kind, f"use one of {', '.join(_KINDS)}.")
        if self.kind == "deepspeed" and self.zero_stage not in (1, 2, 3):
            raise ConfigError("strategy.stage", self.zero_stage, "use ZeRO stage 1, 2 or 3.")
        for key in ("optimizer_buffer_count", "params_buffer_count", "params_buffer_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"strategy.{key}", getattr(self, key), "use a positive whole number.")
        for key in ("sub_group_size", "max_in_cpu"):
            if getattr(self, key) < 0:
                raise ConfigError(f"strategy.{key}", getattr(self, key), "use a whole number >= 0.")
        for key in ("offload_optimizer", "offload_params"):
            if getattr(self, key) not in _PLACES:
                raise ConfigError(f"strategy.{key}", getattr(self, key), f"use one of {', '.join(_PLACES)}.")
        if self.offloads_params and not self.shards_params:
            raise IncompatibleConfigError(
                {"strategy": self.name, "offload_params": self.offload_params},
                "parameter offload exists only in ZeRO-3 and FSDP.",
                "use +strategy=zero3_offload or +strategy=fsdp_offload.",
            )
        if "nvme" in (self.offload_optimizer, self.offload_params) and not (
            self.flat_partitions and self.shards_params
        ):
            raise IncompatibleConfigError(
                {"strategy": self.name, "offload": "nvme"},
                "NVMe offload (ZeRO-Infinity) exists only in ZeRO-3.",
                "use +strategy=zero_infinity.",
            )

    @property
    def has_strategy(self) -> bool:
        """A ``+strategy`` runs (``single``: one device, Lightning's default, none)."""
        return self.kind != "single"


def registered_answers(strategy: Any) -> StrategyQuestions | None:
    """The registered answerer's :class:`StrategyQuestions` for ``strategy`` (``None`` when none is registered).

    The rooms below ``parallel/`` (``models/``, ``precision/``) ask about a user's own strategy (Lightning's
    ``DeepSpeedStrategy`` built around our modules, carrying no spec) here; ``parallel/`` answers, registered by the
    package's ``__init__`` in :mod:`lightning_trainopt.strategy_answers`.
    """
    answered: StrategyQuestions | None = strategy_answers.registered_answers(strategy)
    return answered
