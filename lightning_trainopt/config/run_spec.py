"""The typed run spec: the validated config of ``train.py`` as a frozen tree of plain values, built once.

Like torchtitan's ``JobConfig``: ``config/`` reads the composed Hydra config (``DictConfig``) once, after
``validate_config``, into :class:`RunSpec`; :func:`~lightning_trainopt.config.build.build_run` builds the run's objects
from it and ``launch/train.py`` reads the typed values (``run.parallelism.strategy.shards_params``,
``run.data.batch_size``) instead of string keys. The groups that are instantiated as objects (callbacks, loggers, the
data module, the model, the optimizer) keep their node here as plain dicts and lists (interpolations resolved), so
that nothing below ``config/`` is handed a ``DictConfig`` or ``ListConfig``.

To add a top-level option: declare it in ``conf/train.yaml`` (:func:`~lightning_trainopt.config.keys.root_keys` then
knows the key), add a field to the section it belongs to here and read it in :func:`run_spec`; a test
(``tests/unit/config/test_run_spec.py``) fails while a setting of ``train.yaml`` changes no field of the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_trainopt.config.model_kind import model_kind
from lightning_trainopt.config.parallel_dims import parallel_dims_from_cfg
from lightning_trainopt.config.strategy import plain_node, strategy_spec
from lightning_trainopt.exceptions import ConfigError, cause_of_type
from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.spec import StrategySpec
from lightning_trainopt.precision.spec import PrecisionSpec
from lightning_trainopt.transforms.adapters import AdapterSpec

__all__ = [
    "CallbacksSpec",
    "CheckpointingSpec",
    "DataSpec",
    "LaunchSpec",
    "ModelSpec",
    "Node",
    "OptimizerSpec",
    "ParallelismSpec",
    "RunSpec",
    "TrainerSpec",
    "TransformsSpec",
    "adapter_spec",
    "model_spec",
    "optimizer_spec",
    "run_spec",
    "runs_on_cpu",
]

#: A config node as plain values: ``OmegaConf.to_container(node, resolve=True)``.
Node = dict[str, Any]


_FINDER = "lightning_trainopt.callbacks.MicroBatchFinder"


@dataclass(frozen=True)
class ModelSpec:
    """The model group, and the ``loss`` group that replaces its head's loss.

    Args:
        kind: ``gpt`` (our presets), ``hf`` (a Hugging Face config) or ``module`` (yours).
        name: ``model.name`` of our presets (what metrics.json calls the model), ``None`` when the node has none.
        node: the ``model`` node.
        loss: the ``loss`` node, ``None`` for ``loss=standard`` (a node without ``_target_``).
        distill: the ``distill`` node of ``experiment=distill`` (the teacher and the loss), ``None`` otherwise.
    """

    kind: str
    name: str | None
    node: Node
    loss: Node | None
    distill: Node | None = None


@dataclass(frozen=True)
class DataSpec:
    """The data group.

    Args:
        batch_size: ``data.batch_size``, the micro-batch per device (``None`` when the preset leaves it out).
        seq_len: ``data.seq_len`` (``None`` when the preset has none).
        batch_chosen_at_run_time: a ``MicroBatchFinder`` callback picks the micro-batch once the model is built.
        node: the ``data`` node the data module is built from.
    """

    batch_size: int | None
    seq_len: int | None
    batch_chosen_at_run_time: bool
    node: Node

    @property
    def fixed_batch_size(self) -> int | None:
        """``batch_size`` unless a ``MicroBatchFinder`` chooses it at run time (then unknown: ``None``)."""
        return None if self.batch_chosen_at_run_time else self.batch_size


@dataclass(frozen=True)
class ParallelismSpec:
    """How the run is spread over devices.

    Args:
        strategy: what the ``strategy`` node means (no ``+strategy``: Lightning picks).
        accelerator: ``trainer.accelerator``.
        num_nodes: ``trainer.num_nodes``.
        dims: the split of the ranks into replicas and shards (:class:`ParallelDims`), ``None`` when the config
            does not say how many ranks there are (``devices=auto`` on a machine that decides at run time).
        strategy_node: the ``strategy`` node the strategy is built from (``None``: no ``+strategy``).
    """

    strategy: StrategySpec
    accelerator: str
    num_nodes: int
    dims: ParallelDims | None
    strategy_node: Node | None

    @property
    def on_cpu(self) -> bool:
        """The ranks are CPU processes: ``trainer.accelerator=cpu``, or ``auto`` on a machine without CUDA."""
        return runs_on_cpu(self.accelerator)


@dataclass(frozen=True)
class TransformsSpec:
    """Model rewrites: ``compile`` (``torch.compile`` of the inner model) and the ``activations`` group.

    Args:
        compile: ``compile``.
        activations: the ``_target_`` of each activation preset.
        nodes: the ``activations`` group, ``name: node`` (``null`` entries left out).
    """

    compile: bool
    activations: tuple[str, ...]
    nodes: dict[str, Node]


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer and scheduler groups (each a ``_partial_`` node; ``None`` without one).

    Args:
        target: the optimizer's ``_target_`` (``None`` without an optimizer node).
        node: the ``optimizer`` node.
        scheduler: the ``scheduler`` node.
    """

    target: str | None
    node: Node | None
    scheduler: Node | None


@dataclass(frozen=True)
class CheckpointingSpec:
    """``ckpt_path``: a checkpoint, ``last``, ``auto`` (resume if there is one, else start), or ``None``."""

    ckpt_path: str | None


@dataclass(frozen=True)
class LaunchSpec:
    """How the run starts and ends.

    Args:
        seed: ``seed``.
        continue_on_oom: record an out-of-memory error as ``status: oom`` instead of raising.
        output_dir: ``output_dir``, the run directory of a config composed outside Hydra (``None``: Hydra's, else the
            working directory).
    """

    seed: int
    continue_on_oom: bool
    output_dir: str | None


@dataclass(frozen=True)
class TrainerSpec:
    """The ``trainer`` and ``logger`` groups.

    Args:
        options: the ``trainer`` node: Lightning ``Trainer`` arguments (a ``_target_`` below, e.g. a profiler, is
            built by :func:`~lightning_trainopt.config.build.trainer_kwargs`).
        loggers: the ``logger`` group, ``name: node`` (``null`` entries left out).
    """

    options: Node
    loggers: dict[str, Node]


@dataclass(frozen=True)
class CallbacksSpec:
    """The ``callbacks`` group, ``name: node`` (``null`` entries left out), in the config's order."""

    nodes: dict[str, Node]


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
    trainer: TrainerSpec
    callbacks: CallbacksSpec
    #: the ``adapter`` group (LoRA/QLoRA; ``kind="none"`` by default).
    adapter: AdapterSpec = AdapterSpec()


def run_spec(cfg: DictConfig) -> RunSpec:
    """Read the composed (and validated) ``train.py`` config once into a :class:`RunSpec`.

    Raises:
        ConfigError: a value the typed tree cannot hold (a ``seed`` or ``trainer.num_nodes`` that is not a whole
            number), or whatever :func:`~lightning_trainopt.config.strategy.strategy_spec` refuses.
    """
    trainer: Node = plain_node(cfg.get("trainer")) or {}
    data: Node = plain_node(cfg.get("data")) or {}
    callbacks = _named(cfg.get("callbacks"))
    activations = _named(cfg.get("activations"))
    strategy: Node | None = plain_node(cfg.get("strategy"))
    # Built here, not below: a preset's lists (keep_fp32's module names) reach the spec as lists, not ListConfigs.
    precision = instantiate(cfg.precision, _convert_="all")
    if not isinstance(precision, PrecisionSpec):
        raise ConfigError("precision._target_", type(precision).__name__, "pick a preset with precision=NAME.")
    nodes = trainer.get("num_nodes", 1)
    seed = cfg.get("seed")
    for key, value in (("trainer.num_nodes", nodes), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, value, "use a whole number.")
    batch, seq_len = data.get("batch_size"), data.get("seq_len")
    output_dir = cfg.get("output_dir")
    return RunSpec(
        model=model_spec(cfg),
        data=DataSpec(
            batch_size=batch if isinstance(batch, int) else None,
            seq_len=seq_len if isinstance(seq_len, int) else None,
            batch_chosen_at_run_time=any(_target(node) == _FINDER for node in callbacks.values()),
            node=data,
        ),
        parallelism=ParallelismSpec(
            strategy=strategy_spec(strategy),
            accelerator=str(trainer.get("accelerator", "auto")),
            num_nodes=nodes,
            dims=parallel_dims_from_cfg(cfg),
            strategy_node=strategy,
        ),
        precision=precision,
        transforms=TransformsSpec(
            compile=bool(cfg.get("compile", False)),
            activations=tuple(_target(node) for node in activations.values() if _target(node)),
            nodes=activations,
        ),
        optimizer=optimizer_spec(cfg),
        checkpointing=CheckpointingSpec(ckpt_path=cfg.get("ckpt_path")),
        launch=LaunchSpec(
            seed=seed,
            continue_on_oom=bool(cfg.get("continue_on_oom", False)),
            output_dir=str(output_dir) if output_dir else None,
        ),
        trainer=TrainerSpec(options=trainer, loggers=_named(cfg.get("logger"))),
        callbacks=CallbacksSpec(nodes=callbacks),
        adapter=adapter_spec(cfg),
    )


def adapter_spec(cfg: DictConfig) -> AdapterSpec:
    """The ``adapter`` group as an :class:`AdapterSpec` (``kind="none"`` when the config has no ``adapter`` node).

    Raises:
        ConfigError: a value :class:`AdapterSpec` refuses (naming the ``adapter.*`` key), or a node of another type.
    """
    node = cfg.get("adapter")
    if node is None:
        return AdapterSpec()
    try:
        spec = instantiate(node, _convert_="all")
    except Exception as err:
        # Hydra wraps the spec's own refusal; the user wants the key it names.
        cause = cause_of_type(err, ConfigError)
        if cause is None:
            raise
        raise cause from None
    if not isinstance(spec, AdapterSpec):
        raise ConfigError("adapter._target_", type(spec).__name__, "pick a preset with adapter=none|lora|qlora.")
    return spec


def model_spec(cfg: DictConfig) -> ModelSpec:
    """The ``model`` and ``loss`` groups of a composed ``train.py`` (or ``plan.py``) config.

    Raises:
        ConfigError: ``model=module`` without ``model._target_``.
    """
    kind = model_kind(cfg.model)
    model: Node = plain_node(cfg.model)
    loss = plain_node(cfg.get("loss"))
    distill = plain_node(cfg.get("distill"))
    return ModelSpec(
        kind=kind,
        name=str(model["name"]) if model.get("name") else None,
        node=model,
        loss=loss if isinstance(loss, dict) and "_target_" in loss else None,
        distill=distill if isinstance(distill, dict) and "_target_" in distill else None,
    )


def optimizer_spec(cfg: DictConfig) -> OptimizerSpec:
    """The ``optimizer`` and ``scheduler`` groups of a composed ``train.py`` (or ``plan.py``) config."""
    optimizer: Node | None = plain_node(cfg.get("optimizer")) or None
    return OptimizerSpec(
        target=_target(optimizer) or None, node=optimizer, scheduler=plain_node(cfg.get("scheduler")) or None
    )


def runs_on_cpu(accelerator: str) -> bool:
    """``trainer.accelerator`` runs the ranks as CPU processes (``cpu``, or ``auto`` on a machine without CUDA)."""
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def _named(group: Any) -> dict[str, Node]:
    """A ``name: {_target_: ...}`` group (``callbacks``, ``activations``, ``logger``) as plain nodes, in order.

    Entries set to ``null`` (``callbacks.gpu_monitor=null``) and entries without ``_target_`` are left out, as
    ``train.py`` always did: ``validate_config`` refuses the latter before this is read.
    """
    plain = plain_node(group) or {}
    return {str(k): v for k, v in plain.items() if isinstance(v, dict) and "_target_" in v}


def _target(node: Any) -> str:
    return str(node.get("_target_", "")) if isinstance(node, dict) else ""
