"""LightningModule around the demo transformer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override

from lightning_trainopt.core.schedules import (
    DEFAULT_WARMUP_RATIO,
    check_warmup_cosine,
    resolve_warmup_steps,
    warmup_cosine_factor,
)
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT

__all__ = ["LitGPT", "warmup_cosine"]

OptimizerFactory = Callable[[Iterable[Any]], torch.optim.Optimizer]


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio`` of the peak, stepped once per optimizer step.

    The warmup is ``warmup_steps`` if given, else ``warmup_ratio`` (default
    :data:`~lightning_trainopt.core.schedules.DEFAULT_WARMUP_RATIO`) of ``total_steps``, rounded down
    (:func:`~lightning_trainopt.core.schedules.resolve_warmup_steps`); one line on rank 0 says which it resolved to.

    Raises:
        ConfigError: both warmups given, a warmup not shorter than the run, or a bad value (naming the key).
    """
    check_warmup_cosine(warmup_steps, total_steps, min_lr_ratio, warmup_ratio=warmup_ratio)
    warmup = resolve_warmup_steps(warmup_steps, warmup_ratio, total_steps)
    ratio = DEFAULT_WARMUP_RATIO if warmup_ratio is None else warmup_ratio
    source = "scheduler.warmup_steps" if warmup_steps is not None else f"scheduler.warmup_ratio={ratio}"
    rank_zero_info(f"warmup_cosine: {warmup} warmup steps of {total_steps} optimizer steps ({source}).")
    return LambdaLR(optimizer, lambda step: warmup_cosine_factor(step, warmup, total_steps, min_lr_ratio))


class LitGPT(pl.LightningModule):
    """Next-token language modelling with :class:`~lightning_trainopt.models.GPT`.

    The model is built in ``configure_model`` so that ZeRO-3 and FSDP can shard it while it is created.

    Args:
        model: the model's shape (a :class:`GPTConfig` or its fields as a dict).
        optimizer: a factory ``params -> Optimizer`` (a Hydra partial); default AdamW(lr=3e-4).
        scheduler: a factory ``(optimizer, total_steps=...) -> LRScheduler`` (a Hydra partial) or ``None``.
        compile_model: ``torch.compile`` the inner model (never the LightningModule: ``self.log`` cannot be traced).

    Example::

        module = LitGPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=172))
    """

    def __init__(
        self,
        model: GPTConfig | dict[str, Any],
        optimizer: OptimizerFactory | None = None,
        scheduler: Callable[..., Any] | None = None,
        compile_model: bool = False,
    ) -> None:
        super().__init__()
        self.config = model if isinstance(model, GPTConfig) else GPTConfig(**model)
        self.save_hyperparameters({"model": asdict(self.config), "compile_model": compile_model})
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.compile_model = compile_model
        self.model: torch.nn.Module | None = None

    @override
    def configure_model(self) -> None:
        """Build the model; under DeepSpeed ZeRO-1/2 with a half precision, directly in that half dtype.

        The DeepSpeed engine casts the module's parameters to its bf16/fp16 dtype for ``-mixed`` too (the fp32
        master copy is made from those), so building them in fp32 first only adds a full fp32 copy of the model on
        every rank while it is built: 4 B/param (LLaMA-13B: 48.5 GiB) instead of 2. Lightning's context for this hook
        already puts the tensors on the device (and, for ``-true``, in the half dtype); ZeRO-3 creates them
        partitioned and in its dtype inside ``deepspeed.zero.Init``. The weights are the same: ``normal_`` in bf16
        draws the values an fp32 ``normal_`` rounds to.
        """
        if self.model is not None:
            return
        from lightning.pytorch.strategies import DeepSpeedStrategy

        trainer, half = self._trainer, None
        strategy = trainer.strategy if trainer is not None else None
        if trainer is not None and isinstance(strategy, DeepSpeedStrategy) and not strategy.zero_stage_3:
            precision = str(trainer.precision)
            half = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision[:2] == "16" else None
        default = torch.get_default_dtype()
        torch.set_default_dtype(half or default)
        try:
            model = GPT(self.config)
        finally:
            torch.set_default_dtype(default)
        self.model = cast(torch.nn.Module, torch.compile(model)) if self.compile_model else model

    @property
    def gpt(self) -> GPT:
        """The plain :class:`GPT` (under a compile wrapper, if any)."""
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return cast(GPT, getattr(self.model, "_orig_mod", self.model))

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch[0].shape[0])
        return loss

    def param_groups(self, weight_decay: float | None = None) -> list[dict[str, Any]]:
        """Weight decay on matrices only; norms and other 1-D parameters are not decayed.

        The shape is the parameter's true one: under DeepSpeed ZeRO-3 every partitioned parameter is a 1-D (often
        empty) placeholder whose real shape is ``ds_shape``; judging by ``p.dim()`` there would decay nothing.
        """
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for p in self.parameters():
            if p.requires_grad:
                (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
        groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        if weight_decay is not None:
            groups[0]["weight_decay"] = weight_decay
        return [g for g in groups if g["params"]]

    def _fused_kwargs(self) -> dict[str, Any]:
        """The fused kernel for the ``adamw`` preset on CUDA, where it is safe (see ``fused_adam_kwargs``)."""
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from lightning_trainopt.techniques.optimizers import fused_adam_kwargs

        trainer = self._trainer
        if trainer is None:
            return {}
        return fused_adam_kwargs(
            self.optimizer_factory,
            self.parameters(),
            precision=str(trainer.precision),
            gradient_clip_val=trainer.gradient_clip_val,
            deepspeed=isinstance(trainer.strategy, DeepSpeedStrategy),
        )

    def configure_optimizers(self) -> Any:
        params = self.param_groups()
        optimizer: torch.optim.Optimizer
        if self.optimizer_factory is None:
            optimizer = torch.optim.AdamW(params, lr=3e-4)
        else:
            optimizer = self.optimizer_factory(params, **self._fused_kwargs())
        if self.scheduler_factory is None:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = self.scheduler_factory(optimizer, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
