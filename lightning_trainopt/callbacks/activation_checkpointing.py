"""Activation checkpointing by policy for any LightningModule, without editing it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_trainopt.transforms.checkpointing import (
    CheckpointPlan,
    CheckpointPolicy,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

__all__ = ["ActivationCheckpointing"]

# The Hydra node of conf/activations/checkpoint*.yaml: activations.activation_checkpointing.<argument>.
KEY_PREFIX = "activations.activation_checkpointing"


class ActivationCheckpointing(Callback):
    """Recompute the chosen submodules' forward in backward (non-reentrant ``torch.utils.checkpoint``).

    The modules are wrapped in ``on_fit_start``: after ``configure_model`` built the model and after the strategy
    wrapped or sharded it (DDP, DeepSpeed ZeRO-1/2/3, FSDP2). Only the instance's ``forward`` is replaced, so
    parameter names, state-dict keys and the strategy's hooks stay as they were; ``teardown`` restores the module.

    Under ``train.py`` the app applies the policy itself, in the model rewrite's order
    (:func:`~lightning_trainopt.parallel.apply.rewrite_at_configure_model`, before compile and sharding) and makes
    this callback report-only (:meth:`report_only`): at ``on_fit_start`` it reads what was applied and patches nothing.

    Args:
        module_classes: class names to wrap (``["Block"]``, ``["LlamaDecoderLayer"]``).
        names: qualified submodule names (``fnmatch`` patterns) to wrap, instead of ``module_classes``.
        every_k: wrap every k-th of the chosen modules (2: half the blocks, trading memory for less recompute).

    With neither ``module_classes`` nor ``names`` the transformer blocks are found as the model's largest
    ``nn.ModuleList`` of same-class modules. A model that checkpoints itself (Hugging Face's
    ``gradient_checkpointing_enable()``) is left alone with a warning: a second wrap saves nothing and recomputes
    twice.

    Hugging Face models keep a KV cache by default (``config.use_cache=True``): the recomputed forward gets an empty
    cache of the same class, so it neither appends to the model's cache a second time nor computes differently from
    the forward it replays (see :func:`~lightning_trainopt.transforms.checkpointing.apply_activation_checkpointing`);
    ``use_cache`` is left as it is.

    Raises:
        ConfigError: a bad ``every_k``, both selectors given, or (at fit start) a policy that matches nothing, a
            class name or name pattern that matches nothing, or ``every_k > 1`` over one shared (weight-tied) block.

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
            key_prefix=KEY_PREFIX,
        )
        self.plan: CheckpointPlan | None = None
        self._applied_to: pl.LightningModule | None = None
        self._report_only = False

    def report_only(self) -> None:
        """Patch nothing: the model rewrite applies :attr:`policy` (``train.py``); report what it applied."""
        self._report_only = True

    @property
    def recomputed_fraction(self) -> float:
        """Share of the forward pass's weight-matmul FLOPs recomputed in backward, 0..1 (0 before fit), for HFU.

        Counted over every weight that multiplies activations (``nn.Linear``, ``Conv1D``, attention projections, ...;
        see :class:`~lightning_trainopt.transforms.checkpointing.CheckpointPlan`), per call of a shared block.
        """
        return self.plan.recomputed_fraction if self.plan is not None else 0.0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Idempotent within a fit: MicroBatchFinder calls it first when it precedes this callback in the list.
        if self._applied_to is pl_module:
            return
        self._applied_to = pl_module
        if self._report_only:
            from lightning_trainopt.parallel.apply import rewrite_report

            report = rewrite_report(pl_module)
            if report is None or report.checkpoint is None:
                raise RuntimeError(
                    "ActivationCheckpointing is report-only but the model rewrite did not checkpoint this module: "
                    "call rewrite_at_configure_model with this callback's policy, or drop report_only()."
                )
            self.plan = report.checkpoint
        else:
            self.plan = apply_activation_checkpointing(pl_module, self.policy)
        if self.plan.self_checkpointed:
            rank_zero_warn(
                f"ActivationCheckpointing wraps nothing: {list(self.plan.self_checkpointed[:4])} already checkpoint "
                "themselves (gradient_checkpointing=True); a second checkpoint would save nothing and recompute the "
                "blocks twice. Remove activations=checkpoint, or call gradient_checkpointing_disable() to use ours.",
                category=UserWarning,
            )
            return
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
        # Report-only: the rewrite owns the model's forward (a validate after fit finds it rewritten).
        if self.plan is not None and not self._report_only:
            remove_activation_checkpointing(pl_module, self.plan.wrapped)
        self._applied_to = None

    def summary(self) -> dict[str, Any]:
        """``{"activation_checkpointing": {wrapped, candidates, every_k, recomputed_fraction, flops_factor,
        self_checkpointed}}``.

        ``wrapped``: modules this callback checkpointed; ``candidates``: modules the policy chose from;
        ``recomputed_fraction``: share of the forward's weight-matmul FLOPs recomputed in backward (0..1), also when
        the model checkpoints itself (``self_checkpointed`` lists those modules; ``wrapped`` is then 0);
        ``flops_factor``: hardware / model FLOPs of a step, ``1 + recomputed_fraction / 3``.
        """
        if self.plan is None:
            return {}
        return {
            "activation_checkpointing": {
                "wrapped": len(self.plan.wrapped),
                "candidates": self.plan.n_candidates,
                "every_k": self.policy.every_k,
                "recomputed_fraction": self.plan.recomputed_fraction,
                "flops_factor": self.plan.flops_factor,
                "self_checkpointed": list(self.plan.self_checkpointed),
            }
        }
