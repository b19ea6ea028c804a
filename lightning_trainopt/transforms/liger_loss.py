"""Liger-Kernel's fused linear cross-entropy (Triton, CUDA only) as the model's head + loss (``loss=liger``)."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.chunked_loss import head_weight, run_in_head_call

__all__ = ["LigerLMHeadLoss", "liger_available"]

_INSTALL = "pip install 'lightning_trainopt[gpu]' (liger-kernel)"


def liger_available() -> bool:
    """Liger-Kernel is importable (its kernels also need a CUDA device)."""
    return importlib.util.find_spec("liger_kernel") is not None


class LigerLMHeadLoss:
    """``LigerFusedLinearCrossEntropyLoss`` run through the output head's own call (ZeRO-3/FSDP2 gather the weight).

    Liger computes the head and the loss chunk by chunk in Triton kernels and writes the gradients in forward, so no
    logits are kept: the GPU counterpart of :class:`~lightning_trainopt.transforms.chunked_loss.ChunkedLMHeadLoss`.

    Args:
        ignore_index: the target id that does not count.

    Raises:
        ConfigError: no CUDA device (Liger's kernels are Triton GPU kernels), or Liger-Kernel is not installed;
            raised when the loss is built, before training.
    """

    name = "liger"

    def __init__(self, ignore_index: int = -100) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(
                "loss",
                self.name,
                "Liger-Kernel's fused cross-entropy runs on CUDA only; use loss=chunked_ce here.",
            )
        if not liger_available():
            raise ConfigError("loss", self.name, f"Liger-Kernel is not installed: {_INSTALL}, or use loss=chunked_ce.")
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        self.ignore_index = ignore_index
        self._loss = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)

    def compute(self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss from the head's parameters as they are (call it where they are gathered: inside the head's call)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self._loss(head_weight(head, self.name), flat, targets.reshape(-1), getattr(head, "bias", None))  # type: ignore[no-any-return]

    def __call__(self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head_weight(head, self.name)
        return run_in_head_call(head, lambda h, t: self.compute(head, h, t), hidden, targets)  # type: ignore[no-any-return]
