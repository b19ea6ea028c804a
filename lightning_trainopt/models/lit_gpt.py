"""LightningModule around the demo transformer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any, cast

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override

from lightning_trainopt._compat.torch_internals import compiled_original
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT
from lightning_trainopt.models.lit_lm import HeadLoss, LitLanguageModel
from lightning_trainopt.models.optimization import OptimizerFactory
from lightning_trainopt.optim.schedules import (
    DEFAULT_WARMUP_RATIO,
    check_warmup_cosine,
    resolve_warmup_steps,
    warmup_cosine_factor,
)
from lightning_trainopt.transforms.attention import document_ids
from lightning_trainopt.transforms.chunked_loss import head_returns_loss
from lightning_trainopt.transforms.compile import compile_model

__all__ = ["LitGPT", "warmup_cosine"]


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio`` of the peak, stepped once per optimizer step.

    The warmup is ``warmup_steps`` if given, else ``warmup_ratio`` (default
    :data:`~lightning_trainopt.optim.schedules.DEFAULT_WARMUP_RATIO`) of ``total_steps``, rounded down
    (:func:`~lightning_trainopt.optim.schedules.resolve_warmup_steps`); one line on rank 0 says which it resolved to.

    Raises:
        ConfigError: both warmups given, a warmup not shorter than the run, or a bad value (naming the key).
    """
    check_warmup_cosine(warmup_steps, total_steps, min_lr_ratio, warmup_ratio=warmup_ratio)
    warmup = resolve_warmup_steps(warmup_steps, warmup_ratio, total_steps)
    ratio = DEFAULT_WARMUP_RATIO if warmup_ratio is None else warmup_ratio
    source = "scheduler.warmup_steps" if warmup_steps is not None else f"scheduler.warmup_ratio={ratio}"
    rank_zero_info(f"warmup_cosine: {warmup} warmup steps of {total_steps} optimizer steps ({source}).")
    return LambdaLR(optimizer, lambda step: warmup_cosine_factor(step, warmup, total_steps, min_lr_ratio))


class LitGPT(LitLanguageModel):
    """Next-token language modelling with :class:`~lightning_trainopt.models.GPT`.

    The model is built in ``configure_model`` so that ZeRO-3 and FSDP can shard it while it is created.

    Args:
        model: the model's shape (a :class:`GPTConfig` or its fields as a dict).
        optimizer: a factory ``params -> Optimizer`` (a Hydra partial); default AdamW(lr=3e-4).
        scheduler: a factory ``(optimizer, total_steps=...) -> LRScheduler`` (a Hydra partial) or ``None``.
        compile_model: ``torch.compile`` each block of the inner model in place
            (:func:`~lightning_trainopt.transforms.compile.compile_model`; ``train.py`` compiles through its model
            rewrite instead and leaves this ``False``).
        loss: the head + cross-entropy callable of ``conf/loss`` (``None``: the logits and ``F.cross_entropy``).

    Example::

        module = LitGPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=172))
    """

    def __init__(
        self,
        model: GPTConfig | dict[str, Any],
        optimizer: OptimizerFactory | None = None,
        scheduler: Callable[..., Any] | None = None,
        compile_model: bool = False,
        loss: HeadLoss | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, compile_model, loss)
        self.config = model if isinstance(model, GPTConfig) else GPTConfig(**model)
        self.save_hyperparameters({"model": asdict(self.config), "compile_model": compile_model})

    @override
    def configure_model(self) -> None:
        """Build the model, in the dtype its strategy keeps (:meth:`build_dtype`)."""
        if self.model is not None:
            return
        with self.build_dtype():
            model = GPT(self.config)
        if self.compile_model:
            # In place, block by block: the one way this package compiles (the app's rewrite does the same).
            compile_model(model)
        self.model = model

    @property
    def gpt(self) -> GPT:
        """The plain :class:`GPT` (under a compile wrapper, if any)."""
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return cast(GPT, compiled_original(self.model))

    @override
    def forward(
        self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None, return_hidden: bool = False
    ) -> torch.Tensor:
        """Logits, or the hidden states before ``lm_head`` (see ``GPT.forward``)."""
        assert self.model is not None
        if doc_ids is None and not return_hidden:
            return self.model(idx)  # type: ignore[no-any-return]
        return self.model(idx, doc_ids=doc_ids, return_hidden=return_hidden)  # type: ignore[no-any-return]

    @override
    def batch_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = batch
        doc = None if self.document_eos is None else document_ids(x, self.document_eos)
        if self.head_loss is not None:
            # The model's forward computes the loss where it would compute the logits (see head_returns_loss).
            with head_returns_loss(self.gpt.lm_head, self.head_loss, y):
                return self(x, doc_ids=doc), y.numel()
        logits = self(x, doc_ids=doc)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)), y.numel()
