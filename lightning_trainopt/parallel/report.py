"""Callback that reports the strategy in use and this rank's memory breakdown (metrics.json ``memory_breakdown``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.memory_accounting import MemoryBreakdown, memory_breakdown
from lightning_trainopt.parallel.builder import strategy_info
from lightning_trainopt.parallel.spec import spec_of

__all__ = ["StrategyReport", "strategy_offload"]


def strategy_offload(strategy: Any) -> dict[str, str]:
    """What a strategy offloads, as ``memory_breakdown``'s ``offload`` argument (``{"params", "optimizer_states"}``).

    Read from the strategy's :class:`~lightning_trainopt.parallel.spec.StrategySpec` (:func:`spec_of`): ours carry
    one, any other DeepSpeed strategy (e.g. Lightning's own ``DeepSpeedStrategy`` built by a user) is read from its
    config; everything else offloads nothing.
    """
    return spec_of(strategy).offload_by_category


def _module_of(strategy: Any) -> Any:
    model = strategy.model
    return getattr(model, "module", model)


class StrategyReport(Callback):
    """Measures, once, the bytes of parameters, gradients and optimizer states this rank holds.

    The measurement is taken in ``on_before_optimizer_step`` of optimizer step ``at_step`` (0-based): after the
    backward pass, while gradients exist, and once the optimizer states exist (torch Adam creates them at its first
    step, so the default is the second step). ``summary()`` returns ``{"strategy", "zero_stage", "offload",
    "memory_breakdown": {"params": {"device", "cpu", "nvme"}, ...}}`` for rank 0.

    Args:
        at_step: the optimizer step to measure at.

    Example::

        trainer = Trainer(callbacks=[StrategyReport()], strategy=build_strategy(cfg.strategy, spec, cfg.trainer, 8))
    """

    def __init__(self, at_step: int = 1) -> None:
        if not isinstance(at_step, int) or at_step < 0:
            raise ConfigError("callbacks.strategy_report.at_step", at_step, "use a non-negative step index, e.g. 1.")
        self.at_step = at_step
        self.breakdown: MemoryBreakdown | None = None
        self.info: dict[str, Any] = {}

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.breakdown is not None or trainer.global_step != self.at_step:
            return
        strategy = trainer.strategy
        self.breakdown = memory_breakdown(
            _module_of(strategy), trainer.optimizers, strategy.root_device, offload=strategy_offload(strategy)
        )
        rank_zero_info(f"Memory per rank (bytes, rank 0): {self.breakdown.to_dict()}")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.info = strategy_info(trainer)

    def summary(self) -> dict[str, Any]:
        """The strategy, the engine's ZeRO stage, and ``memory_breakdown`` (``None`` if never measured)."""
        return {**self.info, "memory_breakdown": None if self.breakdown is None else self.breakdown.to_dict()}
