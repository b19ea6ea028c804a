"""Every private attribute of Hugging Face transformers that the package touches.

Written against transformers >=4.40,<6 (:data:`TRANSFORMERS_RANGE`); ``tests/unit/compat/test_transformers.py``
fails naming the change when an upgrade renames or reshapes one of them. Each works on any ``nn.Module``: a model
that is not a Hugging Face one simply has none of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TRANSFORMERS_RANGE", "has_per_module_init", "init_marks_lifted", "no_split_modules"]

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
