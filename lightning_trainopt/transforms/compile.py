"""Regional compilation: ``torch.compile`` each repeated block in place instead of the whole model.

A transformer's blocks share one class and one code path, so Dynamo traces and Inductor compiles the block once and
reuses the graph for every instance (the later blocks only re-check its guards). Compiling the whole model instead
traces every layer into one graph, which for an FP8 model (each linear layer adds casts, amax reductions and scaled
GEMMs to the graph) makes the first step take minutes. PyTorch's "Reducing torch.compile cold start compilation
time with regional compilation" recipe and torchtitan (``apply_compile``: per ``TransformerBlock``) do the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from lightning_trainopt._compat.torch_internals import has_compiled_call, is_compiled
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.blocks import block_classes, own_class

__all__ = ["compile_blocks", "compile_model"]


def compile_blocks(model: nn.Module, classes: Sequence[str] | None = None, **compile_kwargs: Any) -> list[str]:
    """``nn.Module.compile`` every module of the repeated block class, in place. Idempotent.

    In place, so parameter names, state-dict keys and the module tree stay as they were (checkpoints of a compiled
    and an uncompiled run are interchangeable, and FSDP2 or DeepSpeed wrap the same modules).

    Args:
        model: any module.
        classes: class names of the blocks; ``None``: the model's repeated block
            (:func:`~lightning_trainopt.transforms.blocks.block_classes`).
        **compile_kwargs: passed to ``torch.compile`` (``mode``, ``fullgraph``, ``dynamic``, ...).

    Returns:
        the names of the modules compiled by this call (empty when they were already compiled).

    Raises:
        ConfigError: no repeated block is found (compile the whole model instead), or ``classes`` names none.
    """
    wanted = list(classes) if classes is not None else block_classes(model)
    if not wanted:
        raise ConfigError(
            "compile",
            True,
            f"{type(model).__name__} has no repeated block (an nn.ModuleList of same-class modules) to compile one "
            "at a time; compile the whole model instead.",
        )
    found = [(name, m) for name, m in model.named_modules() if name and own_class(m).__name__ in wanted]
    if not found:
        raise ConfigError("compile", True, f"no module of {type(model).__name__} is of the classes {wanted}.")
    compiled = []
    for name, module in found:
        if not is_compiled(module):
            module.compile(**compile_kwargs)
            compiled.append(name)
    return compiled


def compile_model(model: nn.Module, **compile_kwargs: Any) -> list[str]:
    """``torch.compile`` ``model`` in place, the one way this package compiles (the model rewrite's step 4,
    ``LitGPT``/``LitCausalLM``'s ``compile_model``): each repeated block where the model has one
    (:func:`compile_blocks`), else each parameter-holding child (a ``ModuleList``'s modules one by one: a container
    has no forward of its own). Never the LightningModule itself (``self.log`` cannot be traced), and never the output
    head of a model with blocks, so a head loss (``head_returns_loss``) runs eagerly inside the model's forward.
    Idempotent.

    Returns:
        the names of the modules compiled by this call.
    """
    if block_classes(model):
        return compile_blocks(model, **compile_kwargs)

    def units(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                yield from units(child, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", child

    compiled = []
    for name, child in units(model, ""):
        if any(True for _ in child.parameters()) and not has_compiled_call(child):
            child.compile(**compile_kwargs)
            compiled.append(name)
    return compiled
