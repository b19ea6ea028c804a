"""The generic activation estimate: bytes saved for backward by any ``nn.Module``, measured without memory.

The module is built and run under ``FakeTensorMode`` (tensors have shapes, dtypes and storages but no data), and
:class:`~lightning_trainopt.metrics.saved_tensors.SavedTensorsCounter` — the project's one measurement — counts what
autograd keeps. Fake CPU tensors dispatch to the same kernels as real ones (SDPA picks its flash kernel), so the
figure equals a real CPU forward's to the byte; a 7B model is measured on a laptop in seconds. On the ``meta``
device SDPA would fall back to the math kernel and count the T x T scores, which is why fake tensors are used.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_trainopt._compat.torch_internals import builtin_linear
from lightning_trainopt.metrics.flops import meta_copy
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter
from lightning_trainopt.planner.activations import (
    ActivationPolicy,
    compressed_bytes,
    pinned_rounding_term,
    placed_bytes,
    recomputed_block_term,
)
from lightning_trainopt.planner.terms import MemoryEstimate, Term

__all__ = [
    "SavedStorages",
    "fake_module",
    "measure_activation_bytes",
    "measure_saved_storages",
    "measured_activation_terms",
]


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, dict):
        return _default_loss(next(iter(out.values())))
    return _default_loss(out[0])


def measure_activation_bytes(
    build_module: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Any, ...]],
    loss_fn: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Bytes saved for backward by one forward (and loss) of a module, measured on fake tensors.

    Args:
        build_module: returns the module; called inside ``FakeTensorMode`` so its parameters take no memory.
        make_inputs: returns the forward's positional inputs; also called inside the fake mode.
        loss_fn: ``(module, inputs) -> loss``; default: the module's first output, summed in fp32.
        autocast_dtype: run the forward under CPU autocast to this dtype (Lightning's ``*-mixed``).

    Returns:
        Activation bytes (parameters and their views excluded, each storage once).
    """
    from lightning_trainopt._compat.torch_internals import fake_tensor_mode

    with warnings.catch_warnings():
        # The counter asks storages for their address; fake storages answer with a deprecation warning.
        warnings.simplefilter("ignore")
        with fake_tensor_mode(), builtin_linear():
            module = build_module()
            inputs = make_inputs()
            with SavedTensorsCounter(params=module.parameters()) as counter:
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    loss = loss_fn(module, inputs) if loss_fn else _default_loss(module(*inputs))
                del loss
    return counter.report().activation_bytes


def fake_module(module: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``module`` (built on any device, e.g. ``meta``) whose parameters and buffers are CPU tensors of the
    active ``FakeTensorMode``: no memory, and CPU kernels (SDPA's flash kernel) when run. Call it inside the mode.

    Shared parameters stay shared; ``dtype`` casts floating parameters and buffers (as ``module.to(dtype)``).
    """
    copy = meta_copy(module)
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            to = dtype if dtype is not None and t.is_floating_point() else t.dtype
            new = torch.empty(tuple(t.shape), dtype=to, device="cpu")
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    from lightning_trainopt._compat.torch_internals import replace_own_tensors

    for sub in copy.modules():
        replace_own_tensors(sub, fake)
    return copy


@dataclass(frozen=True)
class SavedStorages:
    """What one forward saved for backward, storage by storage, measured on fake tensors.

    Args:
        storages: ``(bytes, element size, floating, weight copy)`` of each activation storage (parameters excluded).
        output_numel: elements of the model's output (the logits: the last parameter-owning module's output).
        output_element_size: bytes per element of that output.
    """

    storages: tuple[tuple[int, int, bool, bool], ...]
    output_numel: int = 0
    output_element_size: int = 4

    @property
    def nbytes(self) -> int:
        return sum(s[0] for s in self.storages)


def _largest_tensor(out: Any) -> torch.Tensor | None:
    found = [t for t in _tensors(out) if t.is_floating_point()]
    return max(found, key=lambda t: t.numel(), default=None)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict) or hasattr(obj, "values"):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def measure_saved_storages(
    build_module: Callable[[], nn.Module],
    make_inputs: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], Any],
    autocast_dtype: torch.dtype | None = None,
    math_attention: bool = False,
    truth_values: bool = False,
) -> SavedStorages:
    """The storages one forward (and loss) saves for backward, measured on fake tensors (no memory, no compute).

    Args:
        build_module: returns the module (e.g. :func:`fake_module` of a meta-built model, with a technique applied);
            called inside ``FakeTensorMode``.
        make_inputs: returns the batch; called inside the mode.
        loss_fn: ``(module, batch) -> loss`` (a LightningModule's ``training_step``).
        autocast_dtype: run under CPU autocast to this dtype (Lightning's ``*-mixed``).
        math_attention: force SDPA's math kernel (``plan.attention=math``).
        truth_values: answer the forward's yes/no questions about tensor values (``if mask.all():``) with yes
            (``MetaTruthValues``), which fake tensors cannot answer: Hugging Face's mask code asks whether a batch has
            padding or packed sequences, and a batch of whole sequences has neither.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_trainopt._compat.torch_internals import MetaTruthValues, fake_tensor_mode

    last: list[torch.Tensor] = []

    def hook(_: nn.Module, __: Any, out: Any) -> None:
        tensor = _largest_tensor(out)
        if tensor is not None:
            last[:] = [tensor]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fake storages answer data_ptr() with a deprecation warning
        truth = MetaTruthValues(fake=True) if truth_values else contextlib.nullcontext()
        with fake_tensor_mode(), truth, builtin_linear():
            module = build_module()
            batch = make_inputs()
            owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
            handles = [m.register_forward_hook(hook) for m in owners]
            kernel = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
            try:
                with SavedTensorsCounter(params=module.parameters()) as counter, kernel:
                    with torch.autocast(
                        "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
                    ):
                        loss = loss_fn(module, batch)
                    del loss
            finally:
                for h in handles:
                    h.remove()
    sizes = {name: torch.empty(0, dtype=getattr(torch, name)).element_size() for _, name, _ in counter.storages()}
    storages = tuple(
        (nbytes, sizes[name], getattr(torch, name).is_floating_point, copy) for nbytes, name, copy in counter.storages()
    )
    out = last[0] if last else None
    return SavedStorages(storages, 0 if out is None else out.numel(), 4 if out is None else out.element_size())


def measured_activation_terms(
    saved: SavedStorages,
    policy: ActivationPolicy,
    compute_bytes: int,
    recomputed_block_bytes: int = 0,
) -> MemoryEstimate:
    """The activation terms of a measured forward under ``policy``'s compression and offload.

    Checkpointing is in the measurement itself (the module was measured with its blocks wrapped). int8 compression
    and offload follow the same rules as the analytic estimate, storage by storage (``activations.compressed_bytes``,
    ``activations.placed_bytes``): a floating storage of at least ``compress_min_numel`` elements stored as int8 codes
    padded to whole blocks plus an fp32 scale per block; storages of at least ``offload_min_numel`` elements moved to
    pinned CPU memory, each rounded up to a power of two.

    Args:
        saved: the measurement (:func:`measure_saved_storages`).
        policy: the activation policy.
        compute_bytes: bytes per element of the compute dtype (for the output's gradient).
        recomputed_block_bytes: one block's saved bytes, held again while checkpointing recomputes it in backward.
    """
    groups: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    for nbytes, size, floating, copy in saved.storages:
        numel = nbytes // size
        kept = compressed_bytes(size, numel, policy) if floating else nbytes
        groups[copy].append((kept, numel))
    terms: list[Term] = []
    rounded = 0
    for copy, label in ((False, "saved for backward (measured, fake tensors)"), (True, "autocast weight copies")):
        tensors = groups[copy]
        if not tensors:
            continue
        kept, moved, pad = placed_bytes(tensors, policy)
        formula = f"{len(tensors)} storages of one forward"
        stays = f"{label} (storages < {policy.offload_min_numel} elements, not offloaded)" if policy.offload else label
        terms.append(Term("activations", "device", stays, kept, formula, phase="backward"))
        terms.append(Term("activations", "cpu", label, moved, formula, phase="backward"))
        rounded += pad
    if rounded:
        terms.append(pinned_rounding_term(rounded, "storages"))
    if recomputed_block_bytes:
        formula = "(saved bytes without - with checkpointing) / blocks"
        terms.append(recomputed_block_term(recomputed_block_bytes, formula))
    out = saved.output_numel
    terms.append(
        Term(
            "other",
            "device",
            "output + its fp32 gradient",
            (saved.output_element_size + 4) * out,
            f"{out:,} elements x ({saved.output_element_size}+4) B",
            phase="backward",
        )
    )
    return MemoryEstimate.of(terms)
