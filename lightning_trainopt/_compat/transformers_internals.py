"""Every private attribute of Hugging Face transformers that the package touches.

Written against transformers >=4.40,<6 (:data:`TRANSFORMERS_RANGE`); ``tests/unit/compat/test_transformers.py``
fails naming the change when an upgrade renames or reshapes one of them. Each works on any ``nn.Module``: a model
that is not a Hugging Face one simply has none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TRANSFORMERS_RANGE", "build_order", "has_per_module_init", "init_marks_lifted", "no_split_modules"]

#: The transformers versions these wrappers were written and tested against: ``[low, high)``.
TRANSFORMERS_RANGE = ("4.40", "6")

_INIT_MARK = "_is_hf_initialized"


def no_split_modules(module: Any) -> list[str]:
    """The class names a Hugging Face model declares must stay whole when sharded (``_no_split_modules``)."""
    names = getattr(module, "_no_split_modules", None) or ()
    return [name for name in names if isinstance(name, str)]


def has_per_module_init(module: Any) -> bool:
    """``module`` is a Hugging Face ``PreTrainedModel`` whose init visits its modules children first
    (``_initialize_weights``, called by ``smart_apply``)."""
    return callable(getattr(module, "_initialize_weights", None))


def build_order(root: Any) -> list[tuple[Any, Callable[[Any], None] | None]]:
    """What building the Hugging Face model(s) in ``root`` eagerly does, step by step: ``(module, None)`` where the
    module is constructed (its ``reset_parameters`` runs), ``(module, init)`` where ``init(module)`` (its model's
    ``_init_weights``) runs; ``[]`` when ``root`` holds no Hugging Face model.

    A ``PreTrainedModel`` constructs its modules in registration order, a nested ``PreTrainedModel`` (the
    ``LlamaModel`` inside ``LlamaForCausalLM``) built and initialised whole by its own ``__init__``'s ``post_init``;
    then its ``post_init`` runs ``initialize_weights``: ``smart_apply``'s walk, children first, with the
    ``_init_weights`` of the nearest ``PreTrainedModel``, skipping the modules a nested model already initialised
    (their ``_is_hf_initialized`` mark). Modules without parameters are listed too: ``_init_weights`` writes a rotary
    embedding's ``inv_freq`` buffers.
    """
    if not any(has_per_module_init(m) for m in root.modules()):
        return []
    steps: list[tuple[Any, Callable[[Any], None] | None]] = []
    constructed: set[int] = set()
    initialised: set[int] = set()

    def initialise(module: Any, init: Callable[[Any], None]) -> None:
        for child in module.children():
            initialise(child, child._init_weights if has_per_module_init(child) else init)
        if id(module) not in initialised:
            initialised.add(id(module))
            steps.append((module, init))

    def construct(module: Any) -> None:
        if id(module) in constructed:
            return
        constructed.add(id(module))
        steps.append((module, None))
        for child in module.children():
            construct(child)
        if has_per_module_init(module):
            initialise(module, module._init_weights)

    construct(root)
    return steps


@contextmanager
def init_marks_lifted(params: Iterable[Any]) -> Iterator[None]:
    """Inside the block, ``params`` carry no ``_is_hf_initialized`` mark, so Hugging Face's init writes them again.

    The mark is put back on exit: it was set by the init that wrote into empty placeholders.
    """
    marks = [(p, p.__dict__.pop(_INIT_MARK)) for p in params if _INIT_MARK in p.__dict__]
    try:
        yield
    finally:
        for p, mark in marks:
            setattr(p, _INIT_MARK, mark)
