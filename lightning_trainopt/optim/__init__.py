"""Optimizers (AdamW, 8-bit and 4-bit ones), their state accounting, learning-rate schedules and micro-batch plans."""

from lightning_trainopt.optim.micro_batch import (
    MicroBatchPlan,
    divisors,
    fit_linear_bytes,
    nearby_global_batches,
    plan_micro_batch,
)
from lightning_trainopt.optim.optimizer_states import OptimizerStateReport, optimizer_state_bytes
from lightning_trainopt.optim.optimizers import adamw, bitsandbytes_optimizer, torchao_optimizer

__all__ = [
    "MicroBatchPlan",
    "OptimizerStateReport",
    "adamw",
    "bitsandbytes_optimizer",
    "divisors",
    "fit_linear_bytes",
    "nearby_global_batches",
    "optimizer_state_bytes",
    "plan_micro_batch",
    "torchao_optimizer",
]
