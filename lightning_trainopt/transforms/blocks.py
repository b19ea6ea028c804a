"""The repeated block of a model (a transformer's layer class): the unit FSDP2 shards and regional compile compiles."""

from __future__ import annotations

import torch

from lightning_trainopt._compat.torch_internals import pre_fsdp_class
from lightning_trainopt._compat.transformers_internals import no_split_modules
from lightning_trainopt.transforms.checkpointing import find_block_list

__all__ = ["block_classes", "own_class"]


def own_class(module: torch.nn.Module) -> type:
    """The module's class, before FSDP2 swapped it for ``FSDP<Name>``."""
    return pre_fsdp_class(type(module))


def block_classes(root: torch.nn.Module) -> list[str]:
    """The class names of the model's repeated block, the units FSDP2 shards when ``shard_modules`` is not given.

    The classes a Hugging Face model names in ``_no_split_modules`` (``LlamaDecoderLayer``, ``GPT2Block``: the blocks
    that must stay whole) that occur in it; else the class of the ``nn.ModuleList`` of same-class modules that holds
    the most parameters (a transformer's blocks: ``Block`` of our GPT, ``TransformerEncoderLayer`` of
    ``nn.TransformerEncoder``); else none.
    """
    present = {own_class(m).__name__ for m in root.modules()}
    named: list[str] = []
    for module in root.modules():
        for name in sorted(no_split_modules(module)):
            if isinstance(name, str) and name in present and name not in named:
                named.append(name)
    if named:
        return named
    found = find_block_list(root)
    return [] if found is None else [own_class(found[1][0]).__name__]
