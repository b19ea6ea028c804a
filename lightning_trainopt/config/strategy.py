"""Read the ``strategy`` node of the composed config once: its :class:`StrategySpec`, and the strategy it builds.

This is where a ``conf/strategy`` node stops being a ``DictConfig``: :func:`strategy_spec` resolves it to plain values
and :func:`~lightning_trainopt.parallel.spec.parse_strategy` reads them; :func:`build_strategy` instantiates the
keyword arguments :func:`~lightning_trainopt.parallel.builder.strategy_kwargs` maps. Below ``config/`` every module
takes the spec (or plain values), never the node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import Strategy
from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.builder import strategy_kwargs
from lightning_trainopt.parallel.spec import StrategySpec, parse_strategy, with_spec
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["build_strategy", "plain_node", "strategy_spec"]


def plain_node(node: Any) -> Any:
    """``node`` with interpolations resolved, as plain dicts and lists (anything that is not a config, unchanged)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def strategy_spec(node: DictConfig | Mapping[str, Any] | None) -> StrategySpec:
    """The :class:`StrategySpec` of a ``strategy`` node (``None``: no ``+strategy``).

    Raises:
        ConfigError: whatever :func:`~lightning_trainopt.parallel.spec.parse_strategy` refuses, naming the key.
    """
    return parse_strategy(plain_node(node))


def build_strategy(
    strategy_cfg: DictConfig | Mapping[str, Any] | None,
    precision: PrecisionSpec,
    trainer_cfg: DictConfig | Mapping[str, Any] | None = None,
    micro_batch_size: int | None = None,
    n_params: int | None = None,
) -> Strategy | str:
    """Instantiate a strategy preset (``cfg.strategy``), or return ``"auto"`` when there is none.

    The node is read once into a :class:`StrategySpec`, which refuses a bad value naming its key before anything is
    built; :func:`~lightning_trainopt.parallel.builder.strategy_kwargs` then fills what DeepSpeed needs (micro-batch,
    ``auto`` bucket sizes, fp16 loss scaling).

    Args:
        strategy_cfg: the ``strategy`` node (``_target_``, ``name`` and keyword arguments) or ``None``.
        precision: the precision preset.
        trainer_cfg: the ``trainer`` node (only checked here; the Trainer itself passes its values at setup).
        micro_batch_size: micro-batch per device.
        n_params: the model's parameter count, for ``auto`` bucket sizes (``None``: unknown, the 5e7 cap applies).

    Raises:
        ConfigError: a missing ``_target_`` or value (``???``), a value :func:`parse_strategy` refuses (e.g. a bucket
            size that is neither a positive whole number nor ``auto``), a non-positive micro-batch, a loss scale that
            is not a power of two, a clipping-by-value request under DeepSpeed, or a ``_target_`` that is no Strategy.
    """
    if strategy_cfg is None:
        return "auto"
    from hydra.utils import instantiate

    node = plain_node(strategy_cfg)
    spec = parse_strategy(node)
    kwargs = strategy_kwargs(spec, node, precision, plain_node(trainer_cfg), micro_batch_size, n_params)
    strategy = instantiate(kwargs, _convert_="all")
    if not isinstance(strategy, Strategy):
        raise ConfigError("strategy._target_", kwargs["_target_"], "point it at a lightning.pytorch Strategy class.")
    strategy.trainopt_preset = spec.name  # type: ignore[attr-defined]
    # The rooms below parallel/ read the strategy's answers from its spec (our classes carry their own).
    return with_spec(strategy, spec)
