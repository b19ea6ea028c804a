"""The training loop shared by the app's language-model LightningModules: loss logging, validation, optimizers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import module_trainer
from lightning_trainopt.models.optimization import (
    OptimizerFactory,
    configure_optimizers,
    decay_param_groups,
    strategy_answers,
)

__all__ = ["HeadLoss", "LitLanguageModel"]

#: ``loss(head, hidden, targets) -> mean loss``: the output head and the cross-entropy in one (``conf/loss``).
HeadLoss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class LitLanguageModel(pl.LightningModule):
    """Next-token language modelling: subclasses build ``self.model`` and compute a batch's loss.

    ``val_loss`` is the mean over the validation tokens of all ranks (a ``torchmetrics.MeanMetric`` weighted by each
    batch's token count, synchronised once per validation), so a last batch that is shorter or a padded batch counts
    as much as its tokens; ``val_ppl`` is its exponential.

    Args:
        optimizer: a factory ``params -> Optimizer`` (a Hydra partial); default AdamW(lr=3e-4).
        scheduler: a factory ``(optimizer, total_steps=...) -> LRScheduler`` (a Hydra partial) or ``None``.
        compile_model: ``torch.compile`` the inner model (never the LightningModule: ``self.log`` cannot be traced).
        loss: the output head + cross-entropy as one callable ``loss(head, hidden, targets)``
            (``transforms.chunked_loss.ChunkedLMHeadLoss``, ``transforms.liger_loss.LigerLMHeadLoss``); ``None``: the
            model's own logits and cross-entropy.

    Example::

        class MyLM(LitLanguageModel):
            def configure_model(self) -> None:
                self.model = build()

            def batch_loss(self, batch):
                return loss, n_tokens
    """

    def __init__(
        self,
        optimizer: OptimizerFactory | None = None,
        scheduler: Callable[..., Any] | None = None,
        compile_model: bool = False,
        loss: HeadLoss | None = None,
    ) -> None:
        super().__init__()
        self.head_loss = loss
        #: The data's end-of-document token: attention stays inside each packed document (``data.document_attention``).
        self.document_eos: int | None = None
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.compile_model = compile_model
        self.model: torch.nn.Module | None = None
        self.val_mean = MeanMetric()

    @contextlib.contextmanager
    def build_dtype(self) -> Iterator[None]:
        """Build the model inside this context in the dtype its strategy keeps: under DeepSpeed ZeRO-1/2 with a half
        precision, that half dtype (the strategy's answers, :func:`~lightning_trainopt.models.optimization
        .strategy_answers`: it wraps the model in an engine and does not build it partitioned).

        The DeepSpeed engine casts the module's parameters to its bf16/fp16 dtype for ``-mixed`` too (the fp32 master
        copy is made from those), so building them in fp32 first only adds a full fp32 copy of the model on every rank
        while it is built: 4 B/param (LLaMA-13B: 48.5 GiB) instead of 2. Lightning's context for ``configure_model``
        already puts the tensors on the device (and, for ``-true``, in the half dtype); ZeRO-3 creates them
        partitioned and in its dtype inside ``deepspeed.zero.Init``. The weights are the same: ``normal_`` in bf16
        draws the values an fp32 ``normal_`` rounds to.
        """
        trainer, half = module_trainer(self), None
        answers = strategy_answers(self)
        if trainer is not None and answers is not None and answers.wraps_in_engine and not answers.builds_partitioned:
            precision = str(trainer.precision)
            half = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision[:2] == "16" else None
        default = torch.get_default_dtype()
        torch.set_default_dtype(half or default)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def batch_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | int]:
        """The batch's mean next-token loss and the number of tokens it averages over."""
        raise NotImplementedError

    @staticmethod
    def batch_size_of(batch: Any) -> int:
        """Sequences in a ``(x, y)`` or ``{input_ids, ...}`` batch."""
        inputs = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        return int(inputs.shape[0])

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = self.batch_loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=self.batch_size_of(batch))
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, tokens = self.batch_loss(batch)
        self.val_mean.update(loss.detach().float(), weight=tokens)
        return loss

    @override
    def on_validation_epoch_end(self) -> None:
        # compute() reduces the sums over all ranks, so every rank logs the same value (sync_dist averages equal
        # values: it only tells Lightning the value is global).
        loss = self.val_mean.compute()
        self.val_mean.reset()
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", torch.exp(loss), sync_dist=True)

    def param_groups(self, weight_decay: float | None = None) -> list[dict[str, Any]]:
        """Weight decay on matrices only (``decay_param_groups``, which reads ZeRO-3's ``ds_shape``)."""
        return decay_param_groups(self.parameters(), weight_decay)

    @override
    def configure_optimizers(self) -> Any:
        return configure_optimizers(self, self.optimizer_factory, self.scheduler_factory)
