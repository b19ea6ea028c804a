"""Read the composed ``train.py`` config once (:func:`read_run`) and build the run's objects from the typed spec.

This is the one place where ``train.py``'s config turns into objects: :func:`read_run` checks the ``DictConfig`` and
reads it into a :class:`~lightning_trainopt.config.run_spec.RunSpec`; :func:`build_run` instantiates the data module,
the LightningModule, the activation techniques, the callbacks, the loggers and the strategy from the spec's plain
nodes, and :func:`trainer_kwargs` the ``trainer`` node's arguments. Every ``instantiate`` converts the node's values to
plain dicts and lists (``_convert_="all"``), so nothing below ``config/`` is handed a ``DictConfig`` or ``ListConfig``.
``launch/train.py`` orchestrates what this returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig

from lightning_trainopt.config.data_vocab import apply_hf_synthetic_vocab, apply_manifest_vocab
from lightning_trainopt.config.model_factory import (
    build_module,
    count_params,
    meta_module_of,
    model_name,
    model_vocab_size,
)
from lightning_trainopt.config.rewrite import install_app_rewrites
from lightning_trainopt.config.run_spec import DataSpec, Node, RunSpec, run_spec, runs_on_cpu
from lightning_trainopt.config.strategy import build_strategy, plain_node
from lightning_trainopt.config.validate import validate_config
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import LitGPT

__all__ = [
    "BuiltRun",
    "build_run",
    "config_runs_on_cpu",
    "data_vocab_size",
    "micro_batch",
    "read_run",
    "trainer_kwargs",
]

log = logging.getLogger(__name__)


@dataclass
class BuiltRun:
    """What :func:`build_run` builds from a :class:`RunSpec`: everything the Trainer is given but its own arguments.

    Args:
        datamodule: the ``data`` group's LightningDataModule (its source checked).
        module: the LightningModule, with the ordered model rewrite installed at the end of its ``configure_model``.
        name: what metrics.json calls the model.
        n_params: the model's parameter count (of its meta copy when the module builds its model later).
        callbacks: the ``activations`` group's callbacks (report-only: the model rewrite applies them), then the
            ``callbacks`` group's, in the config's order.
        loggers: the ``logger`` group's loggers.
        strategy: the ``strategy`` node's Strategy, or ``"auto"`` without ``+strategy``.
    """

    datamodule: Any
    module: pl.LightningModule
    name: str
    n_params: int
    callbacks: list[Callback]
    loggers: list[Logger]
    strategy: Strategy | str


def config_runs_on_cpu(cfg: DictConfig) -> bool:
    """The composed config's ranks are CPU processes (read before validation: the console is set up first)."""
    trainer = cfg.get("trainer") or {}
    return runs_on_cpu(str(trainer.get("accelerator", "auto")))


def read_run(cfg: DictConfig, launch_check: Callable[[Mapping[str, Any]], None] | None = None) -> RunSpec:
    """Check the composed ``train.py`` config and read it once into a :class:`RunSpec`.

    In this order: ``data=tokenized`` sets our model's vocabulary from the shards' manifest; every key and value is
    validated; ``launch_check`` (the launcher's check that ``trainer.devices``/``num_nodes`` match the processes
    torchrun started) is given the ``trainer`` node as plain values; the pre-flight rules run and their advice is
    logged; the ranks' split into replicas (:class:`~lightning_trainopt.parallel.dims.ParallelDims`) is validated as
    the spec is read, before anything is spawned.

    Raises:
        ConfigError: a config value is invalid.
        IncompatibleConfigError: a combination of options is known to break.
    """
    apply_manifest_vocab(cfg)
    apply_hf_synthetic_vocab(cfg)
    validate_config(cfg)
    if launch_check is not None:
        launch_check(plain_node(cfg.trainer))
    from lightning_trainopt.config.preflight import preflight

    for advice in preflight(cfg):
        log.warning(advice)
    return run_spec(cfg)


def build_run(run: RunSpec) -> BuiltRun:
    """Build the data module, the LightningModule, the callbacks, the loggers and the strategy ``run`` describes.

    The model rewrite (activation techniques, ``compile``) is installed on the module; the vocabularies of the model
    and the data are checked against each other.

    Raises:
        ConfigError: a node that cannot be built (a missing data file, a model node the app cannot build),
            ``data.document_attention`` with a model other than our presets, or data with more token ids than the
            model embeds.
    """
    from lightning_trainopt.config.preflight import check_vocab

    datamodule = instantiate(run.data.node, _convert_="all")
    if hasattr(datamodule, "check_source"):
        datamodule.check_source()
    dims = run.parallelism.dims
    module = build_module(run.model, run.optimizer, tensor_parallel=dims.tp if dims is not None else 1)
    _document_attention(module, datamodule)
    vocab_key = "model.overrides.vocab_size" if run.model.kind == "hf" else "model.vocab_size"
    check_vocab(model_vocab_size(module), data_vocab_size(datamodule), vocab_key)
    # The module's own count once built (a user's module may build its model in __init__), else its meta copy's.
    n_params = count_params(module) or count_params(meta_module_of(run.model, run.optimizer))
    activations = _instantiate_named(run.transforms.nodes)
    # The activation techniques and compile are applied by the ordered model rewrite at the end of configure_model
    # (before any strategy wraps or shards the model, so before every on_fit_start measurement); the callbacks report.
    install_app_rewrites(module, activations, compile_model=run.transforms.compile, adapter=run.adapter)
    callbacks = [*activations, *_instantiate_named(run.callbacks.nodes)]
    loggers = _instantiate_named(run.trainer.loggers)
    strategy = build_strategy(
        run.parallelism.strategy_node,
        run.precision,
        run.trainer.options,
        micro_batch_size=micro_batch(run.data, datamodule),
        n_params=n_params,
    )
    return BuiltRun(datamodule, module, model_name(run.model.name, module), n_params, callbacks, loggers, strategy)


def trainer_kwargs(run: RunSpec) -> dict[str, Any]:
    """The ``trainer`` node's Lightning ``Trainer`` arguments, a ``_target_`` among them built.

    Instantiated, not just copied: ``debug=profiler`` puts a profiler object under ``trainer.profiler``.
    """
    kwargs: dict[str, Any] = instantiate(run.trainer.options, _convert_="all")
    return kwargs


def micro_batch(data: DataSpec, datamodule: Any) -> int | None:
    """The micro-batch per device: the datamodule's ``batch_size`` (a MicroBatchFinder sets it), else the config's."""
    value = getattr(datamodule, "batch_size", None)
    if value is None:
        value = data.batch_size
    return value if isinstance(value, int) else None


def data_vocab_size(datamodule: Any) -> int | None:
    """Token ids the data holds: byte-level text 256, else the datamodule's ``vocab_size`` when it has one."""
    corpus = getattr(datamodule, "corpus", None)
    if isinstance(corpus, str) and corpus != "synthetic":
        return 256
    value = getattr(datamodule, "vocab_size", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _instantiate_named(group: Mapping[str, Node]) -> list[Any]:
    """Instantiate every entry of a ``name: {_target_: ...}`` group (``callbacks``, ``activations``, ``logger``)."""
    return [instantiate(node, _convert_="all") for node in group.values()]


def _document_attention(module: pl.LightningModule, datamodule: Any) -> None:
    """``data.document_attention=true``: our GPT masks attention at the data's EOS ids (refused for other models)."""
    if not getattr(datamodule, "document_attention", False):
        return
    if not isinstance(module, LitGPT):
        raise ConfigError(
            "data.document_attention",
            True,
            f"masking attention at document boundaries is built into our model presets, not {type(module).__name__}; "
            "use a gpt_* / llama_* model preset or data.document_attention=false.",
        )
    module.document_eos = int(datamodule.eos_id)
    rank_zero_info(f"data.document_attention: attention stays inside documents (EOS id {module.document_eos}).")
