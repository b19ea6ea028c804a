"""The app's model rewrite: the ``activations=`` group (and ``compile``) applied by the ordered rewrite, not by hooks.

``train.py`` instantiates the ``activations=`` callbacks as before (their arguments are validated there, and their
``summary()`` is what metrics.json reports), turns them into one :class:`~lightning_trainopt.parallel.apply.RewritePlan`
and makes them report-only: the model is rewritten once, in the documented order, at the end of ``configure_model``
(:func:`~lightning_trainopt.parallel.apply.rewrite_at_configure_model`), for every strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl

from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_trainopt.callbacks.activation_offload import _SavedTensorsTransformCallback
from lightning_trainopt.checkpoint.adapter_state import install_adapter_checkpointing
from lightning_trainopt.parallel.apply import RewritePlan, rewrite_at_configure_model
from lightning_trainopt.transforms.adapters import AdapterSpec

__all__ = ["app_rewrite_plan", "install_app_rewrites"]


def app_rewrite_plan(
    callbacks: Sequence[Any], compile_model: bool = False, adapter: AdapterSpec | None = None
) -> RewritePlan:
    """The plan of the activation callbacks among ``callbacks`` (others are ignored), of ``compile`` and of the
    ``adapter`` group (``None`` or ``kind="none"``: no adapter)."""
    checkpoint = next((cb.policy for cb in callbacks if isinstance(cb, ActivationCheckpointing)), None)
    saved = [cb for cb in callbacks if isinstance(cb, _SavedTensorsTransformCallback)]
    return RewritePlan(
        checkpoint=checkpoint,
        saved_tensors=saved[0].transform if saved else None,
        compile=compile_model,
        adapter=adapter if adapter is not None and adapter.enabled else None,
    )


def install_app_rewrites(
    module: pl.LightningModule,
    callbacks: Sequence[Any],
    compile_model: bool = False,
    adapter: AdapterSpec | None = None,
) -> None:
    """Rewrite ``module`` at the end of its ``configure_model`` by :func:`app_rewrite_plan`, and make the activation
    callbacks among ``callbacks`` report-only (they stay in the Trainer for their ``summary()`` and log line).

    Two saved-tensors callbacks (offload and int8) are left to their own ``setup``, which refuses the pair with the
    fix; nothing is installed for them here.
    """
    saved = [cb for cb in callbacks if isinstance(cb, _SavedTensorsTransformCallback)]
    if len(saved) > 1:
        return
    plan = app_rewrite_plan(callbacks, compile_model, adapter)
    if plan == RewritePlan():
        return
    for cb in callbacks:
        if isinstance(cb, (ActivationCheckpointing, _SavedTensorsTransformCallback)):
            cb.report_only()
    rewrite_at_configure_model(module, plan)
    if plan.adapter is not None:
        # Checkpoints then hold the adapters without the frozen base, which the resumed run rebuilds and checks.
        install_adapter_checkpointing(module, plan.adapter)
