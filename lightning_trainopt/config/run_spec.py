"""The typed run spec: the validated config of ``train.py`` as a frozen tree of plain values, built once.

Like torchtitan's ``JobConfig``: ``config/`` reads the composed Hydra config (``DictConfig``) once, after
``validate_config``, into :class:`RunSpec`; ``launch/train.py`` and what it calls below ``config/`` read the typed
values (``run.parallelism.strategy.shards_params``, ``run.data.batch_size``) instead of string keys. The groups that
are instantiated as objects (callbacks, loggers, the data module, the model) stay nodes of the config; their typed
part here is what the run needs to know about them before building them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_trainopt.config.model_factory import model_kind
from lightning_trainopt.config.parallel_dims import parallel_dims_from_cfg
from lightning_trainopt.config.strategy import plain_node, strategy_spec
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.spec import StrategySpec
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = [
    "CheckpointingSpec",
    "DataSpec",
    "LaunchSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "RunSpec",
    "TransformsSpec",
    "run_spec",
]

_FINDER = "lightning_trainopt.callbacks.MicroBatchFinder"


@dataclass(frozen=True)
class ModelSpec:
    """The model group: ``kind`` is ``gpt`` (our presets), ``hf`` (a Hugging Face config) or ``module`` (yours)."""

    kind: str


@dataclass(frozen=True)
class DataSpec:
    """The data group.

    Args:
        batch_size: ``data.batch_size``, the micro-batch per device (``None`` when the preset leaves it out).
        seq_len: ``data.seq_len`` (``None`` when the preset has none).
        batch_chosen_at_run_time: a ``MicroBatchFinder`` callback picks the micro-batch once the model is built.
    """

    batch_size: int | None
    seq_len: int | None
    batch_chosen_at_run_time: bool


@dataclass(frozen=True)
class ParallelismSpec:
    """How the run is spread over devices.

    Args:
        strategy: what the ``strategy`` node means (no ``+strategy``: Lightning picks).
        accelerator: ``trainer.accelerator``.
        num_nodes: ``trainer.num_nodes``.
        dims: the split of the ranks into replicas and shards (:class:`ParallelDims`), ``None`` when the config
            does not say how many ranks there are (``devices=auto`` on a machine that decides at run time).
    """

    strategy: StrategySpec
    accelerator: str
    num_nodes: int
    dims: ParallelDims | None


@dataclass(frozen=True)
class TransformsSpec:
    """Model rewrites: ``compile`` (``torch.compile`` of the inner model) and the activation presets' targets."""

    compile: bool
    activations: tuple[str, ...]


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer group's ``_target_`` (``None`` without an optimizer node)."""

    target: str | None


@dataclass(frozen=True)
class CheckpointingSpec:
    """``ckpt_path``: a checkpoint, ``last``, ``auto`` (resume if there is one, else start), or ``None``."""

    ckpt_path: str | None


@dataclass(frozen=True)
class LaunchSpec:
    """``seed`` and ``continue_on_oom`` (record an out-of-memory error as ``status: oom`` instead of raising)."""

    seed: int
    continue_on_oom: bool


@dataclass(frozen=True)
class RunSpec:
    """The validated ``train.py`` config as typed values: build one with :func:`run_spec`.

    Example::

        run = run_spec(cfg)
        run.parallelism.strategy.shards_params, run.precision.trainer_precision, run.data.batch_size
    """

    model: ModelSpec
    data: DataSpec
    parallelism: ParallelismSpec
    precision: PrecisionSpec
    transforms: TransformsSpec
    optimizer: OptimizerSpec
    checkpointing: CheckpointingSpec
    launch: LaunchSpec


def run_spec(cfg: DictConfig) -> RunSpec:
    """Read the composed (and validated) ``train.py`` config once into a :class:`RunSpec`.

    Raises:
        ConfigError: a value the typed tree cannot hold (a ``seed`` or ``trainer.num_nodes`` that is not a whole
            number), or whatever :func:`~lightning_trainopt.config.strategy.strategy_spec` refuses.
    """
    trainer: dict[str, Any] = plain_node(cfg.get("trainer")) or {}
    data: dict[str, Any] = plain_node(cfg.get("data")) or {}
    callbacks: dict[str, Any] = plain_node(cfg.get("callbacks")) or {}
    activations: dict[str, Any] = plain_node(cfg.get("activations")) or {}
    optimizer: dict[str, Any] = plain_node(cfg.get("optimizer")) or {}
    precision = instantiate(cfg.precision)
    if not isinstance(precision, PrecisionSpec):
        raise ConfigError("precision._target_", type(precision).__name__, "pick a preset with precision=NAME.")
    nodes = trainer.get("num_nodes", 1)
    seed = cfg.get("seed")
    for key, value in (("trainer.num_nodes", nodes), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, value, "use a whole number.")
    batch, seq_len = data.get("batch_size"), data.get("seq_len")
    return RunSpec(
        model=ModelSpec(kind=model_kind(cfg.model)),
        data=DataSpec(
            batch_size=batch if isinstance(batch, int) else None,
            seq_len=seq_len if isinstance(seq_len, int) else None,
            batch_chosen_at_run_time=any(_target(node) == _FINDER for node in callbacks.values()),
        ),
        parallelism=ParallelismSpec(
            strategy=strategy_spec(cfg.get("strategy")),
            accelerator=str(trainer.get("accelerator", "auto")),
            num_nodes=nodes,
            dims=parallel_dims_from_cfg(cfg),
        ),
        precision=precision,
        transforms=TransformsSpec(
            compile=bool(cfg.get("compile", False)),
            activations=tuple(_target(node) for node in activations.values() if _target(node)),
        ),
        optimizer=OptimizerSpec(target=_target(optimizer) or None),
        checkpointing=CheckpointingSpec(ckpt_path=cfg.get("ckpt_path")),
        launch=LaunchSpec(seed=seed, continue_on_oom=bool(cfg.get("continue_on_oom", False))),
    )


def _target(node: Any) -> str:
    return str(node.get("_target_", "")) if isinstance(node, dict) else ""
