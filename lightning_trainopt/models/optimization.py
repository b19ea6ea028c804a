"""The optimizer and schedule of any LightningModule from the app's ``optimizer``/``scheduler`` partials."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_trainopt._compat.lightning_internals import module_trainer
from lightning_trainopt.planner.strategy_layout import StrategyQuestions, registered_answers

__all__ = [
    "OptimizerFactory",
    "configure_optimizers",
    "decay_param_groups",
    "strategy_answers",
]

OptimizerFactory = Callable[[Iterable[Any]], torch.optim.Optimizer]


def decay_param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float | None = None) -> list[dict[str, Any]]:
    """Weight decay on matrices only; norms, biases and other 1-D parameters are not decayed.

    The shape is the parameter's true one: under DeepSpeed ZeRO-3 every partitioned parameter is a 1-D (often empty)
    placeholder whose real shape is ``ds_shape``; judging by ``p.dim()`` there would decay nothing.

    Args:
        params: the module's parameters; frozen ones are left out.
        weight_decay: the decay of the matrices' group, or ``None`` for the optimizer's own.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in params:
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if weight_decay is not None:
        groups[0]["weight_decay"] = weight_decay
    return [g for g in groups if g["params"]]


def strategy_answers(module: pl.LightningModule) -> StrategyQuestions | None:
    """What the module's strategy does, or ``None`` without a Trainer.

    The answers are worked out in ``parallel/``: carried by the strategy (``trainer.strategy.spec``: our strategies
    carry their own; the app's builder and ``lightning_trainopt.parallel.with_spec`` give one to Lightning's), else
    asked of the answerer ``parallel/`` registered (:mod:`lightning_trainopt.strategy_answers`), so this room never
    tests a strategy's class.
    """
    trainer = module_trainer(module)
    if trainer is None:
        return None
    answers = getattr(trainer.strategy, "spec", None)
    if not isinstance(answers, StrategyQuestions):
        answers = registered_answers(trainer.strategy)
    return answers if isinstance(answers, StrategyQuestions) else None


def _fused_kwargs(module: pl.LightningModule, factory: OptimizerFactory | None) -> dict[str, Any]:
    """The fused kernel for the ``adamw`` preset on CUDA, where it is safe (see ``fused_adam_kwargs``)."""
    from lightning_trainopt.optim.optimizers import fused_adam_kwargs

    trainer = module_trainer(module)
    if trainer is None:
        return {}
    answers = strategy_answers(module)
    return fused_adam_kwargs(
        factory,
        module.parameters(),
        precision=str(trainer.precision),
        gradient_clip_val=trainer.gradient_clip_val,
        # An engine (DeepSpeed) runs its own optimizer step on flat partitions.
        deepspeed=answers is not None and answers.wraps_in_engine,
    )


def configure_optimizers(
    module: pl.LightningModule, optimizer: OptimizerFactory | None, scheduler: Callable[..., Any] | None
) -> Any:
    """What ``configure_optimizers`` returns for ``module``: the optimizer over its decay groups, and the schedule.

    Args:
        module: the LightningModule, attached to its Trainer.
        optimizer: a factory ``params -> Optimizer`` (a Hydra partial); ``None``: AdamW(lr=3e-4).
        scheduler: a factory ``(optimizer, total_steps=...) -> LRScheduler`` stepped once per optimizer step, or
            ``None`` for a constant rate.
    """
    params = decay_param_groups(module.parameters())
    opt = (
        torch.optim.AdamW(params, lr=3e-4)
        if optimizer is None
        else optimizer(params, **_fused_kwargs(module, optimizer))
    )
    if scheduler is None:
        return opt
    total = int(module.trainer.estimated_stepping_batches)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt, total_steps=total), "interval": "step"}}
