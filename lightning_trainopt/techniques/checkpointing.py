"""Activation checkpointing of chosen submodules of any ``nn.Module``, without editing its code.

The chosen modules' ``forward`` is replaced, on the instance, by a non-reentrant ``torch.utils.checkpoint`` call of
the original. Module classes, parameter names, state-dict keys and hooks stay as they were, so wrapping can happen
after DDP / DeepSpeed / FSDP2 have wrapped or sharded the model, and checkpoints stay loadable without it.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_trainopt.exceptions import ConfigError

__all__ = [
    "CheckpointPlan",
    "CheckpointPolicy",
    "apply_activation_checkpointing",
    "find_block_list",
    "is_checkpointed",
    "remove_activation_checkpointing",
    "select_modules",
]

_ORIGINAL_FORWARD = "_trainopt_original_forward"
# Read by SpeedMonitor to count recomputed blocks for HFU.
_MARK = "_trainopt_checkpointed"


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which submodules to checkpoint.

    Exactly one of ``module_classes`` / ``names`` may be given; with neither, the policy targets the model's
    transformer blocks (the children of its largest ``nn.ModuleList`` of same-class modules).
    ``every_k`` then keeps every k-th of the targets (indices 0, k, 2k, ...), the others run normally.

    Args:
        module_classes: class names (``"Block"``, ``"LlamaDecoderLayer"``); subclasses and FSDP2's ``FSDPBlock``
            match through the class hierarchy.
        names: qualified submodule names relative to the root, ``fnmatch`` patterns allowed (``"model.blocks.*"``).
        every_k: checkpoint every k-th target (1: all).
        key_prefix: prefix of the config keys in error messages.
    """

    module_classes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    every_k: int = 1
    key_prefix: str = "activations.checkpoint"

    def __post_init__(self) -> None:
        object.__setattr__(self, "module_classes", tuple(self.module_classes))
        object.__setattr__(self, "names", tuple(self.names))
        if self.module_classes and self.names:
            raise ConfigError(
                f"{self.key_prefix}.names",
                list(self.names),
                "give either module_classes or names, not both (module_classes picks by type, names by path).",
            )
        if not isinstance(self.every_k, int) or isinstance(self.every_k, bool) or self.every_k < 1:
            raise ConfigError(
                f"{self.key_prefix}.every_k", self.every_k, "use a positive integer (1: every block, 2: every 2nd)."
            )
        for key, values in (("module_classes", self.module_classes), ("names", self.names)):
            if any(not isinstance(v, str) or not v for v in values):
                raise ConfigError(f"{self.key_prefix}.{key}", list(values), "use a list of non-empty strings.")


@dataclass(frozen=True)
class CheckpointPlan:
    """What a policy wrapped, and how much forward work is recomputed in backward.

    Args:
        wrapped: qualified names of the checkpointed modules.
        n_candidates: number of modules the policy chose from (before ``every_k``).
        recomputed_params: ``nn.Linear`` parameters inside wrapped modules (their forward matmuls run twice).
        linear_params: ``nn.Linear`` parameters of the whole model (each counted once, tied weights included).
    """

    wrapped: tuple[str, ...]
    n_candidates: int
    recomputed_params: int
    linear_params: int

    @property
    def recomputed_fraction(self) -> float:
        """Share of the forward pass's matmul FLOPs that backward recomputes (0..1)."""
        return self.recomputed_params / self.linear_params if self.linear_params else 0.0

    @property
    def flops_factor(self) -> float:
        """Hardware FLOPs / model FLOPs of a training step (forward is a third of 6N): ``1 + fraction / 3``."""
        return 1.0 + self.recomputed_fraction / 3.0


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def find_block_list(root: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` of same-class modules holding the most parameters (a transformer's blocks)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in root.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 1:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        n = sum(p.numel() for p in module.parameters())
        if best is None or n > best[0]:
            best = (n, name, module)
    return None if best is None else (best[1], best[2])


def select_modules(root: nn.Module, policy: CheckpointPolicy) -> tuple[list[tuple[str, nn.Module]], int]:
    """The ``(name, module)`` pairs the policy wraps, outermost only, in module order, and the candidate count.

    Raises:
        ConfigError: the policy matches nothing in ``root``.
    """
    if policy.module_classes:
        wanted = set(policy.module_classes)
        candidates = [(n, m) for n, m in root.named_modules() if n and _class_names(m) & wanted]
        key, value = f"{policy.key_prefix}.module_classes", list(policy.module_classes)
        hint = sorted({type(m).__name__ for _, m in root.named_modules()})[:20]
        fix = f"use class names present in the model, e.g. one of {hint}."
    elif policy.names:
        candidates = [
            (n, m) for n, m in root.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in policy.names)
        ]
        key, value = f"{policy.key_prefix}.names", list(policy.names)
        hint = [n for n, _ in root.named_modules() if n][:10]
        fix = f"use qualified submodule names of the LightningModule, e.g. {hint}."
    else:
        found = find_block_list(root)
        candidates = [] if found is None else [(f"{found[0]}.{i}", m) for i, m in enumerate(found[1])]
        key, value = f"{policy.key_prefix}.module_classes", []
        fix = "the model has no nn.ModuleList of blocks; name the modules with module_classes or names."
    outermost: list[tuple[str, nn.Module]] = []
    for name, module in candidates:
        if not any(name.startswith(f"{outer}.") for outer, _ in outermost):
            outermost.append((name, module))
    if not outermost:
        raise ConfigError(key, value, fix)
    return outermost[:: policy.every_k], len(outermost)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` wrapped this module."""
    return _ORIGINAL_FORWARD in module.__dict__


def _linear_params(root: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for module in root.modules():
        if isinstance(module, nn.Linear):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


def _checkpointed_forward(original: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        # Evaluation and inference save nothing for backward; checkpointing would only cost time.
        return original(*args, **kwargs)
    return checkpoint(original, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(root: nn.Module, policy: CheckpointPolicy) -> CheckpointPlan:
    """Checkpoint the submodules of ``root`` chosen by ``policy`` (idempotent) and say what was wrapped.

    Raises:
        ConfigError: the policy matches nothing.
    """
    chosen, n_candidates = select_modules(root, policy)
    for _, module in chosen:
        if is_checkpointed(module):
            continue
        original = module.forward
        module.__dict__[_ORIGINAL_FORWARD] = original
        module.__dict__[_MARK] = True
        module.forward = functools.partial(_checkpointed_forward, original)
    recomputed = sum(_linear_params(m) for _, m in chosen)
    return CheckpointPlan(
        wrapped=tuple(n for n, _ in chosen),
        n_candidates=n_candidates,
        recomputed_params=recomputed,
        linear_params=_linear_params(root),
    )


def remove_activation_checkpointing(root: nn.Module, names: Sequence[str] | None = None) -> int:
    """Restore the original ``forward`` of wrapped modules (all, or those named); return how many."""
    restored = 0
    for name, module in root.named_modules():
        if is_checkpointed(module) and (names is None or name in names):
            original = module.__dict__.pop(_ORIGINAL_FORWARD)
            module.__dict__.pop(_MARK, None)
            if getattr(original, "__func__", None) is type(module).forward:
                del module.__dict__["forward"]
            else:
                module.forward = original
            restored += 1
    return restored
