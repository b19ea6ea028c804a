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
    "self_checkpointing_modules",
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
    key_prefix: str = "activations.activation_checkpointing"

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

    Forward matmul FLOPs per token are taken as 2 x the elements of the weights that multiply activations: every
    parameter of two or more dimensions except those of ``nn.Embedding`` (a lookup), so ``nn.Linear``, Hugging Face
    ``Conv1D``, ``nn.MultiheadAttention``'s ``in_proj_weight`` and the like all count. A weight counts once per path
    to its module in the module tree, i.e. once per call for a block shared by several slots of a ``ModuleList``
    (ALBERT-style weight sharing); a block called several times from one slot is counted once (its calls cannot be
    seen without running it). Attention's score matmuls (no weights) are left out of both sides, as in ``6N``.
    The share is an upper bound: torch's non-reentrant checkpoint stops replaying once every saved tensor is rebuilt,
    so a region's last matmul (whose output nothing saves, e.g. an FFN down-projection) is not re-run, and a region
    with nothing that needs a gradient replays nothing. ``SpeedMonitor`` measures the real replay with its flop
    counter, and for our model counts it exactly (:class:`~lightning_trainopt.metrics.flops.TransformerFlops`).

    Args:
        wrapped: qualified names of the checkpointed modules.
        n_candidates: number of modules the policy chose from (before ``every_k``).
        recomputed_params: matmul weight elements inside wrapped modules (their forward runs twice), per call.
        linear_params: matmul weight elements of the whole model, per call (tied weights of an embedding and its
            output head count once, through the head).
        self_checkpointed: names of modules that checkpoint themselves (``gradient_checkpointing=True``, e.g. after
            Hugging Face's ``gradient_checkpointing_enable()``); nothing is wrapped then (see
            :func:`apply_activation_checkpointing`).
    """

    wrapped: tuple[str, ...]
    n_candidates: int
    recomputed_params: int
    linear_params: int
    self_checkpointed: tuple[str, ...] = ()

    @property
    def recomputed_fraction(self) -> float:
        """Share of the forward pass's weight-matmul FLOPs inside wrapped modules (0..1): an upper bound on what
        backward recomputes (see the class docstring)."""
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


def _modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    # Every path, so a block shared by several ModuleList slots appears once per slot (once per call).
    return [(n, m) for n, m in root.named_modules(remove_duplicate=False) if n]


def select_modules(root: nn.Module, policy: CheckpointPolicy) -> tuple[list[tuple[str, nn.Module]], int]:
    """The ``(name, module)`` pairs the policy wraps, outermost only, in module order, and the candidate count.

    A module object reached by several paths (one block shared by several slots of a ``ModuleList``) is a
    candidate once per path; checkpointing works per object, so all its calls are checkpointed.

    Raises:
        ConfigError: the policy matches nothing in ``root``; a class name or name pattern of the policy matches
            nothing (a typo next to a valid entry); ``every_k > 1`` over candidates that share one module object.
    """
    modules = _modules(root)
    if policy.module_classes:
        key, value = f"{policy.key_prefix}.module_classes", list(policy.module_classes)
        candidates = [(n, m) for n, m in modules if _class_names(m) & set(policy.module_classes)]
        present = set().union(*(_class_names(m) for _, m in modules)) if modules else set()
        unmatched = [c for c in policy.module_classes if c not in present]
        hint = sorted({type(m).__name__ for _, m in modules})[:20]
        fix = f"use class names present in the model, e.g. one of {hint}."
    elif policy.names:
        key, value = f"{policy.key_prefix}.names", list(policy.names)
        candidates = [(n, m) for n, m in modules if any(fnmatch.fnmatchcase(n, p) for p in policy.names)]
        unmatched = [p for p in policy.names if not any(fnmatch.fnmatchcase(n, p) for n, _ in modules)]
        hint = [n for n, _ in modules][:10]
        fix = f"use qualified submodule names of the LightningModule, e.g. {hint}."
    else:
        found = find_block_list(root)
        candidates = [] if found is None else [(f"{found[0]}.{i}", m) for i, m in enumerate(found[1])]
        key, value, unmatched = f"{policy.key_prefix}.module_classes", [], []
        fix = "the model has no nn.ModuleList of blocks; name the modules with module_classes or names."
    if unmatched and len(unmatched) < len(value):
        raise ConfigError(key, value, f"{unmatched} matched nothing; {fix}")
    outermost: list[tuple[str, nn.Module]] = []
    for name, module in candidates:
        if not any(name.startswith(f"{outer}.") for outer, _ in outermost):
            outermost.append((name, module))
    if not outermost:
        raise ConfigError(key, value, fix)
    if policy.every_k > 1 and len({id(m) for _, m in outermost}) < len(outermost):
        shared = sorted({n for n, m in outermost if sum(m is o for _, o in outermost) > 1})
        raise ConfigError(
            f"{policy.key_prefix}.every_k",
            policy.every_k,
            f"the candidates {shared[:6]} are one module object shared by several slots (weight sharing); "
            "checkpointing applies to the object, so every call of it is checkpointed whatever every_k says. "
            "Use every_k=1 (every call of the shared block is then checkpointed, as it would be anyway).",
        )
    return outermost[:: policy.every_k], len(outermost)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` wrapped this module."""
    return _ORIGINAL_FORWARD in module.__dict__


def _numel(p: torch.Tensor) -> int:
    # DeepSpeed ZeRO-3 leaves an empty placeholder; the real size is ds_numel.
    return int(getattr(p, "ds_numel", p.numel()))


def _is_matmul_weight(p: torch.Tensor) -> bool:
    return len(getattr(p, "ds_shape", p.shape)) >= 2


def _matmul_params(root: nn.Module, prefix: str = "") -> int:
    """Matmul weight elements under ``root``, once per path to their module (see :class:`CheckpointPlan`)."""
    total = 0
    for _, module in [(prefix, root), *_modules(root)]:
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            continue
        total += sum(_numel(p) for p in module.parameters(recurse=False) if _is_matmul_weight(p))
    return total


def self_checkpointing_modules(root: nn.Module) -> list[str]:
    """Names of modules that checkpoint themselves (``gradient_checkpointing`` set to ``True``, as Hugging Face's
    ``gradient_checkpointing_enable()`` does on the model and its layers)."""
    return [n or "<root>" for n, m in root.named_modules() if getattr(m, "gradient_checkpointing", False) is True]


def _is_kv_cache(value: Any) -> bool:
    """``value`` is a Hugging Face KV cache (a ``transformers.cache_utils.Cache``), told by its class hierarchy."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _fresh_cache(cache: Any) -> Any:
    """An empty cache of ``cache``'s class, or ``None`` for a class that needs arguments (``EncoderDecoderCache``)."""
    try:
        return type(cache)()
    except TypeError:
        return None


def _checkpointed_forward(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)`` under non-reentrant checkpointing.

    A Hugging Face block is called with the model's KV cache (``config.use_cache=True``, the default), and its forward
    appends this step's keys and values to it. The recompute in backward gets an empty cache of the same class
    instead: appending to the model's cache a second time would double the keys (with a padded ``attention_mask``
    backward fails: "The size of tensor a (8) must match the size of tensor b (4)"), and passing no cache would run
    attention on the uncached key/value views where the forward ran it on the cache's copies, which rounds
    differently (transformers 5.25, GPT-2 with attention dropout: weights 1e-6 apart after 2 steps). With an empty
    cache the recompute replays the forward exactly, and the user's ``use_cache`` is left as it is.
    """
    if not torch.is_grad_enabled():
        # Evaluation and inference save nothing for backward; checkpointing would only cost time.
        return original(*args, **kwargs)
    calls = 0

    def run(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:  # the recompute in backward
            a = tuple(_fresh_cache(v) if _is_kv_cache(v) else v for v in a)
            kw = {k: _fresh_cache(v) if _is_kv_cache(v) else v for k, v in kw.items()}
        return original(*a, **kw)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(root: nn.Module, policy: CheckpointPolicy) -> CheckpointPlan:
    """Checkpoint the submodules of ``root`` chosen by ``policy`` (idempotent) and say what was wrapped.

    A model that checkpoints itself (:func:`self_checkpointing_modules`) is left alone: wrapping its blocks again
    saves nothing more and adds a second recompute pass. The plan then lists those modules in
    ``self_checkpointed``, wraps nothing, and counts the policy's blocks as recomputed (the model's own
    checkpointing recomputes its layers; Hugging Face checkpoints exactly its decoder layers). That share is an
    estimate; ``SpeedMonitor``'s flop counter measures the recomputation itself.

    Raises:
        ConfigError: the policy matches nothing, names something that matches nothing, or asks for ``every_k > 1``
            over one shared module object.
    """
    chosen, n_candidates = select_modules(root, policy)
    own = tuple(self_checkpointing_modules(root))
    if not own:
        for _, module in chosen:
            if is_checkpointed(module):
                continue
            original = module.forward
            module.__dict__[_ORIGINAL_FORWARD] = original
            module.__dict__[_MARK] = True
            module.forward = functools.partial(_checkpointed_forward, original)
    return CheckpointPlan(
        wrapped=() if own else tuple(n for n, _ in chosen),
        n_candidates=n_candidates,
        recomputed_params=sum(_matmul_params(m, n) for n, m in chosen),
        linear_params=_matmul_params(root),
        self_checkpointed=own,
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
