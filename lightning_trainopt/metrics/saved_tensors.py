"""The project's one measurement of bytes saved for backward ("activation memory").

Autograd keeps, between forward and backward, every tensor an operation saves for its gradient. This module
counts them through ``torch.autograd.graph.saved_tensors_hooks``:

- bytes are counted per **unique storage**, so views of one tensor (``x``, ``x.t()``, ``x[0]``) count once, and
  a storage counts whole (a small view of a big tensor keeps the big tensor alive);
- tensors that share storage with a parameter (a ``Linear`` saves its weight) are reported apart as
  ``parameter_bytes``: they are model states, not activations;
- autocast's half-precision casts of parameters, saved for the input gradient, are activations but are also reported
  as ``weight_copy_bytes`` (they do not grow with the micro-batch): a cast of a trainable parameter is traced through
  autograd, a cast of a frozen one (LoRA's base weights) is matched by value against the frozen ``params`` given:
  an index built when the counter is created finds a weight-shaped saved tensor's candidate (shape, device and a few
  sampled values) with one small read, and the candidate is confirmed element by element in bounded chunks;
- what is counted is what is **really kept**. A memory technique that changes what is stored (8-bit
  compression, CPU offload) registers a :class:`SavedTensorsTransform` through :func:`transform_saved_tensors`;
  the counter then counts the transform's output (int8 data + scales, a CPU copy), not the original. Non-reentrant
  ``torch.utils.checkpoint`` installs its own hooks inside a checkpointed region, which take precedence, so
  the counter sees only what checkpointing keeps (the region's inputs).

Only the innermost ``saved_tensors_hooks`` pair applies when several are nested. To make counters and
transforms compose whatever order they are entered and left in (Lightning calls ``on_train_batch_end`` in the
same callback order as ``on_train_batch_start``, not reversed), this module installs **one** dispatching hook
pair while any counter or transform is active and keeps their state in Python.

The count is the total of distinct storages saved while counting: a storage freed during the forward pass (a
graph branch dropped early) and its address reused by another is told apart by a weak reference, so the figure does
not depend on the allocator's address reuse. Across several forward passes (gradient accumulation) call
:meth:`SavedTensorsCounter.reset` between them, or read :attr:`SavedTensorsCounter.peak` after calling
:meth:`SavedTensorsCounter.mark` at each boundary.
Checkpointing's recomputation during backward briefly holds one region's activations; that is not "saved for
backward" and is not counted here (a device-memory peak shows it).

Example::

    with SavedTensorsCounter(params=model.parameters()) as counter:
        loss = model(x).sum()
    report = counter.report()          # activation_bytes, parameter_bytes, by_device, by_dtype, ...
    loss.backward()
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lightning_trainopt._compat.torch_internals import tensor_base
from lightning_trainopt.metrics.frozen_weights import FrozenWeightIndex

__all__ = [
    "SavedTensorsCounter",
    "SavedTensorsReport",
    "SavedTensorsTransform",
    "is_parameter_tensor",
    "measure_saved_tensors",
    "transform_saved_tensors",
]


def _base_or_self(t: torch.Tensor) -> torch.Tensor:
    base = tensor_base(t)
    return t if base is None else base


class SavedTensorsTransform(Protocol):
    """Changes how a saved tensor is stored (compression, offload); ``unpack(pack(t))`` must give ``t`` back.

    ``pack`` returns a tensor, a tuple/list/dict of them, or an object with a ``stored_tensors()`` method listing
    the tensors it keeps: the counter counts exactly those.
    """

    def pack(self, tensor: torch.Tensor) -> Any: ...

    def unpack(self, packed: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class SavedTensorsReport:
    """Bytes saved for backward during one counted region.

    Args:
        activation_bytes: unique storage bytes kept for backward, parameters excluded (what a technique cuts).
        parameter_bytes: unique storage bytes of saved tensors that are parameters or views of them.
        n_saved: number of tensors autograd asked to save (pack calls), parameters included.
        n_storages: number of unique non-parameter storages counted.
        by_device: ``activation_bytes`` split by device type (``cpu``, ``cuda``), e.g. to show offload.
        by_dtype: ``activation_bytes`` split by dtype name (``float32``, ``int8``, ...).
        weight_copy_bytes: the part of ``activation_bytes`` that is dtype casts of parameters (autocast's
            half-precision weight copies, kept for the input gradient): it does not grow with the micro-batch.
            Casts of frozen parameters (``requires_grad=False``) are in it when the counter was given them as
            ``params``.
    """

    activation_bytes: int
    parameter_bytes: int
    n_saved: int
    n_storages: int
    by_device: dict[str, int] = field(default_factory=dict)
    by_dtype: dict[str, int] = field(default_factory=dict)
    weight_copy_bytes: int = 0

    def device_bytes(self, device_type: str) -> int:
        """Activation bytes resident on one device type (``"cuda"``, ``"cpu"``)."""
        return self.by_device.get(device_type, 0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe dict (for metrics.json)."""
        return {
            "activation_bytes": self.activation_bytes,
            "parameter_bytes": self.parameter_bytes,
            "n_saved": self.n_saved,
            "n_storages": self.n_storages,
            "by_device": dict(self.by_device),
            "by_dtype": dict(self.by_dtype),
            "weight_copy_bytes": self.weight_copy_bytes,
        }


def _storage_key(t: torch.Tensor) -> tuple[str, int, int]:
    """(device, address, bytes) of the storage behind ``t``; tensor subclasses without one fall back to ``id``."""
    try:
        storage = t.untyped_storage()
        return str(t.device), storage.data_ptr() or id(storage), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return str(t.device), id(t), t.numel() * t.element_size()


def _storage_ref(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage (torch keeps one Python object per live storage), or ``None``."""
    try:
        return weakref.ref(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def is_parameter_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view of one (a leaf that requires grad): model state, not activation."""
    return _is_parameter(t, set())


def _is_parameter(t: torch.Tensor, param_keys: set[tuple[str, int]]) -> bool:
    if isinstance(t, torch.nn.Parameter):
        return True
    base = tensor_base(t)
    if base is not None and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)):
        return True
    if not param_keys:
        return False
    device, ptr, _ = _storage_key(t)
    return (device, ptr) in param_keys


def is_weight_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the tensor it views) is a dtype cast of a trainable ``nn.Parameter``, as autocast makes.

    Traced through autograd: the cast's ``ToCopyBackward0`` node leads straight to the parameter's gradient
    accumulator. A cast of a frozen parameter has no autograd history and is not recognised here;
    :class:`SavedTensorsCounter` recognises it by value among the frozen ``params`` it is given.
    """
    base = _base_or_self(t)
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(isinstance(getattr(nxt, "variable", None), torch.nn.Parameter) for nxt, _ in fn.next_functions)


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)
    elif callable(getattr(obj, "stored_tensors", None)):
        yield from _tensors_in(obj.stored_tensors())


class SavedTensorsCounter:
    """Counts the bytes autograd saves for backward while it is active (a context manager).

    Args:
        params: parameters whose storages are reported as ``parameter_bytes`` rather than activations.
            ``nn.Parameter`` instances and views of leaf tensors that require grad are recognised without it;
            pass it where parameters are swapped for gathered copies (ZeRO-3, FSDP). A saved tensor without autograd
            history equal to a frozen one (``requires_grad=False``) cast to another dtype (autocast's copy of a frozen
            weight, or a view of it) counts in ``weight_copy_bytes``. The frozen ones are indexed when the counter is
            created, by shape, device and 16 sampled values in bf16/fp16: a saved tensor shaped like one of them costs
            one 16-element read to find its candidates (usually one), each confirmed chunk by chunk (at most 2**20
            elements cast at a time), once per storage. DTensor, quantized and meta parameters are not indexed.

    Example::

        with SavedTensorsCounter() as counter:
            loss = model(x).sum()
        print(counter.report().activation_bytes)
    """

    def __init__(self, params: Iterable[torch.Tensor] | None = None) -> None:
        params = list(params) if params is not None else []
        self._param_keys: set[tuple[str, int]] = set()
        for p in params:
            device, ptr, _ = _storage_key(p)
            self._param_keys.add((device, ptr))
        self._frozen = FrozenWeightIndex(params)
        self.peak = 0
        self.peak_weight_copy_bytes = 0
        self.n_marks = 0
        self.reset()

    def reset(self) -> None:
        """Forget everything counted so far (``peak`` included)."""
        self._storages: dict[tuple[Any, ...], tuple[int, str, str]] = {}
        self._param_storages: dict[tuple[Any, ...], int] = {}
        self._copy_keys: set[tuple[Any, ...]] = set()
        self._cast_checked: dict[tuple[Any, ...], tuple[Any, bool]] = {}
        self._refs: dict[tuple[Any, ...], Any] = {}
        self._retired: list[tuple[tuple[Any, ...], int]] = []
        self._generation = 0
        self._n_saved = 0
        self.peak = 0
        self.peak_weight_copy_bytes = 0
        self.n_marks = 0

    def mark(self) -> int:
        """End one forward pass: fold its activation bytes into :attr:`peak`, start the next count, return them."""
        report = self.report()
        now = report.activation_bytes
        if now >= self.peak:
            self.peak, self.peak_weight_copy_bytes = now, report.weight_copy_bytes
        self.n_marks += 1
        self._storages, self._param_storages, self._n_saved = {}, {}, 0
        self._copy_keys, self._cast_checked = set(), {}
        self._refs, self._retired = {}, []
        return now

    def record(self, stored: Any, original: torch.Tensor) -> None:
        """Count what is really kept for ``original``: ``stored`` is a tensor or a nest of tensors."""
        self._n_saved += 1
        weight_copy = is_weight_copy(original) or self._is_frozen_weight_copy(original)
        for t in _tensors_in(stored):
            device, ptr, nbytes = _storage_key(t)
            key: tuple[Any, ...] = (device, ptr)
            ref = _storage_ref(t)
            known = self._refs.get(key)
            if known is not None and ref is not None and known() is None:
                # The storage seen at this address was freed and the address reused: a different storage.
                self._generation += 1
                self._refs[key] = ref
                self._retired.append((key, self._generation))
            elif known is None:
                self._refs[key] = ref
            key = (*key, self._retired_generation(key))
            if _is_parameter(t, self._param_keys):
                self._param_storages[key] = nbytes
            else:
                self._storages[key] = (nbytes, t.device.type, str(t.dtype).removeprefix("torch."))
                if weight_copy:
                    self._copy_keys.add(key)

    def _is_frozen_weight_copy(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) is a cast, without autograd history, of a frozen one of ``params``."""
        base = _base_or_self(t)
        if type(base) is not torch.Tensor or base.grad_fn is not None or not base.is_floating_point():
            return False
        if base.layout is not torch.strided or (base.shape, str(base.device)) not in self._frozen.shapes:
            return False
        key = _storage_key(base)
        ref, known = self._cast_checked.get(key, (None, False))
        if ref is not None and ref() is not None:
            return known
        found = self._frozen.holds_cast(base)
        ref = _storage_ref(base)
        if ref is not None:
            self._cast_checked[key] = (ref, found)
        return found

    def _retired_generation(self, key: tuple[Any, ...]) -> int:
        for old, generation in reversed(self._retired):
            if old == key:
                return generation
        return 0

    def report(self) -> SavedTensorsReport:
        """What has been counted since the last :meth:`reset` / :meth:`mark`."""
        by_device: dict[str, int] = {}
        by_dtype: dict[str, int] = {}
        for nbytes, device_type, dtype in self._storages.values():
            by_device[device_type] = by_device.get(device_type, 0) + nbytes
            by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        return SavedTensorsReport(
            activation_bytes=sum(by_device.values()),
            parameter_bytes=sum(self._param_storages.values()),
            n_saved=self._n_saved,
            n_storages=len(self._storages),
            weight_copy_bytes=sum(self._storages[k][0] for k in self._copy_keys if k in self._storages),
            by_device=by_device,
            by_dtype=by_dtype,
        )

    def storages(self) -> list[tuple[int, str, bool]]:
        """Each activation storage counted since the last :meth:`reset` / :meth:`mark`: ``(bytes, dtype name,
        is a weight copy)``, for estimates that apply a technique's rule storage by storage."""
        return [(nbytes, dtype, key in self._copy_keys) for key, (nbytes, _, dtype) in self._storages.items()]

    def start(self) -> None:
        """Begin counting (``__enter__`` calls this)."""
        _STATE.add_counter(self)

    def stop(self) -> None:
        """Stop counting (``__exit__`` calls this); may be called in any order relative to other counters."""
        _STATE.remove_counter(self)

    def __enter__(self) -> SavedTensorsCounter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Dispatch:
    """The single installed hook pair; counters and the transform are looked up at pack time."""

    def __init__(self) -> None:
        self.counters: list[SavedTensorsCounter] = []
        self.transforms: list[SavedTensorsTransform] = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._lock = threading.Lock()

    def _sync(self) -> None:
        active = bool(self.counters or self.transforms)
        if active and self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        elif not active and self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def add_counter(self, counter: SavedTensorsCounter) -> None:
        with self._lock:
            if counter in self.counters:
                raise RuntimeError("this SavedTensorsCounter is already active")
            self.counters.append(counter)
            self._sync()

    def remove_counter(self, counter: SavedTensorsCounter) -> None:
        with self._lock:
            if counter in self.counters:
                self.counters.remove(counter)
            self._sync()

    def add_transform(self, transform: SavedTensorsTransform) -> None:
        with self._lock:
            if self.transforms:
                raise RuntimeError(
                    f"a saved-tensors transform is already active ({type(self.transforms[0]).__name__}); "
                    f"only one of ActivationOffload / ActivationCompression can be used at a time"
                )
            self.transforms.append(transform)
            self._sync()

    def remove_transform(self, transform: SavedTensorsTransform) -> None:
        with self._lock:
            if transform in self.transforms:
                self.transforms.remove(transform)
            self._sync()

    def _pack(self, tensor: torch.Tensor) -> tuple[SavedTensorsTransform | None, Any]:
        if tensor.device.type == "meta":
            # A meta-device pass (SpeedMonitor's FLOP count, a shape probe) saves no data: nothing to transform
            # (copying it out would raise) and no bytes to count.
            return None, tensor
        transform = self.transforms[0] if self.transforms else None
        stored = transform.pack(tensor) if transform is not None else tensor
        for counter in self.counters:
            counter.record(stored, tensor)
        return transform, stored

    @staticmethod
    def _unpack(packed: tuple[SavedTensorsTransform | None, Any]) -> torch.Tensor:
        transform, stored = packed
        return transform.unpack(stored) if transform is not None else stored


_STATE = _Dispatch()


@contextmanager
def transform_saved_tensors(transform: SavedTensorsTransform) -> Iterator[SavedTensorsTransform]:
    """Store every tensor saved for backward through ``transform`` while active; counters see its output.

    Raises:
        RuntimeError: another transform is already active (they do not stack).
    """
    _STATE.add_transform(transform)
    try:
        yield transform
    finally:
        _STATE.remove_transform(transform)


def measure_saved_tensors(
    fn: Any, *args: Any, params: Iterable[torch.Tensor] | None = None, **kwargs: Any
) -> tuple[Any, SavedTensorsReport]:
    """Run ``fn(*args, **kwargs)`` (a forward pass) under a fresh counter; return its output and the report."""
    with SavedTensorsCounter(params=params) as counter:
        out = fn(*args, **kwargs)
    return out, counter.report()
