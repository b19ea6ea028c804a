"""Activation checkpointing by policy for any LightningModule, without editing it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt.techniques.checkpointing import (
    CheckpointPlan,
    CheckpointPolicy,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

__all__ = ["ActivationCheckpointing"]


class ActivationCheckpointing(Callback):
    """Recompute the chosen submodules' forward in backward (non-reentrant ``torch.utils.checkpoint``).

    The modules are wrapped in ``on_fit_start``: after ``configure_model`` built the model and after the strategy
    wrapped or sharded it (DDP, DeepSpeed ZeRO-1/2/3, FSDP2). Only the instance's ``forward`` is replaced, so
    parameter names, state-dict keys and the strategy's hooks stay as they were; ``teardown`` restores the module.

    Args:
        module_classes: class names to wrap (``["Block"]``, ``["LlamaDecoderLayer"]``).
        names: qualified submodule names (``fnmatch`` patterns) to wrap, instead of ``module_classes``.
        every_k: wrap every k-th of the chosen modules (2: half the blocks, trading memory for less recompute).

    With neither ``module_classes`` nor ``names`` the transformer blocks are found as the model's largest
    ``nn.ModuleList`` of same-class modules.

    Raises:
        ConfigError: a bad ``every_k``, both selectors given, or (at fit start) a policy that matches nothing.

    Example::

        trainer = Trainer(callbacks=[ActivationCheckpointing(module_classes=["Block"], every_k=2)])
    """

    def __init__(
        self,
        module_classes: Sequence[str] | None = None,
        names: Sequence[str] | None = None,
        every_k: int = 1,
    ) -> None:
        self.policy = CheckpointPolicy(
            module_classes=tuple(module_classes or ()),
            names=tuple(names or ()),
            every_k=every_k,
            key_prefix="activations.checkpoint",
        )
        self.plan: CheckpointPlan | None = None

    @property
    def recomputed_fraction(self) -> float:
        """Share of the forward pass's matmul FLOPs recomputed in backward (0 before fit), for HFU."""
        return self.plan.recomputed_fraction if self.plan is not None else 0.0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plan = apply_activation_checkpointing(pl_module, self.policy)
        rank_zero_info(
            f"ActivationCheckpointing: {len(self.plan.wrapped)} of {self.plan.n_candidates} modules checkpointed "
            f"({', '.join(self.plan.wrapped[:4])}{', ...' if len(self.plan.wrapped) > 4 else ''}); "
            f"{self.plan.recomputed_fraction:.0%} of the forward matmuls recomputed."
        )

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning does not call Callback.teardown when fit raises (trainer/call.py), so clean up here too.
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.plan is not None:
            remove_activation_checkpointing(pl_module, self.plan.wrapped)

    def summary(self) -> dict[str, Any]:
        """``{"activation_checkpointing": {wrapped, candidates, every_k, recomputed_fraction, flops_factor}}``."""
        if self.plan is None:
            return {}
        return {
            "activation_checkpointing": {
                "wrapped": len(self.plan.wrapped),
                "candidates": self.plan.n_candidates,
                "every_k": self.policy.every_k,
                "recomputed_fraction": self.plan.recomputed_fraction,
                "flops_factor": self.plan.flops_factor,
            }
        }
