"""The one place that touches private torch APIs, each behind a version/availability guard.

Nothing else in lightning_trainopt may call ``torch.cuda.memory._record_memory_history``, ``_dump_snapshot``,
``torch.cuda._get_nvml_device_index``, read DDP's ``_comm_hooks`` / ``_get_ddp_logging_data``, override
``FlopCounterMode._count_flops``, define a ``TorchDispatchMode``, reach ``torch._C._nn.linear`` or ask
``torch.utils.cpp_extension`` for a JIT build directory, or call ``torch._foreach_norm``; when torch changes them, only
this file changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_trainopt._compat._guard import UpstreamChangedError, changed, private_attr

__all__ = [
    "TORCH_RANGE",
    "MetaTruthValues",
    "collective_result",
    "compiled_original",
    "fake_tensor_mode",
    "has_compiled_call",
    "pre_fsdp_class",
    "replace_own_tensors",
    "tensor_base",
    "tensor_version",
    "builtin_linear",
    "own_parameters",
    "restore_builtin_linear",
    "RecomputeFlopCounter",
    "ddp_comm_hook_name",
    "ddp_comm_hook_state",
    "dump_memory_snapshot",
    "extension_build_dir",
    "foreach_norms",
    "head_colwise_parallel",
    "is_compiled",
    "local_box",
    "memory_history_supported",
    "nvml_device_index",
    "reparametrized",
    "start_memory_history",
    "stop_memory_history",
]


def memory_history_supported() -> bool:
    """CUDA allocator history can be recorded (a CUDA build, a visible device, and the private API present)."""
    return (
        torch.cuda.is_available()
        and hasattr(torch.cuda.memory, "_record_memory_history")
        and hasattr(torch.cuda.memory, "_dump_snapshot")
    )


def start_memory_history(max_entries: int = 100_000, stacks: str = "python") -> None:
    """Start recording allocator events (``torch.cuda.memory._record_memory_history``, torch >= 2.1 signature)."""
    if not memory_history_supported():
        raise RuntimeError("CUDA memory history needs a CUDA device and torch >= 2.1")
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries, stacks=stacks)  # type: ignore[arg-type]


def stop_memory_history() -> None:
    """Stop recording allocator events (no-op where unsupported)."""
    if memory_history_supported():
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded history as a pickle that https://pytorch.org/memory_viz opens."""
    if not memory_history_supported():
        raise RuntimeError("CUDA memory snapshots need a CUDA device and torch >= 2.1")
    torch.cuda.memory._dump_snapshot(path)


def nvml_device_index(device: Any) -> int:
    """NVML index of a CUDA device, honouring ``CUDA_VISIBLE_DEVICES`` (falls back to the CUDA index)."""
    index = torch.device(device).index if not isinstance(device, int) else device
    index = torch.cuda.current_device() if index is None else index
    getter = getattr(torch.cuda, "_get_nvml_device_index", None)
    return int(getter(index)) if getter is not None else int(index)


def ddp_comm_hook_name(ddp: Any) -> str | None:
    """Name of the communication hook already registered on a DDP module, or None.

    DDP keeps Python hooks in ``_comm_hooks`` and records every hook (built-in C++ ones too) in its logging data;
    a second registration raises inside the reducer, so callers check first.
    """
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        return getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
    logging_data = getattr(ddp, "_get_ddp_logging_data", None)
    if logging_data is not None:
        name = logging_data().get("comm_hook")
        if name:
            return str(name)
    return None


def ddp_comm_hook_state(ddp: Any) -> Any | None:
    """The state object of the Python communication hook registered on a DDP module (None if there is none)."""
    hooks = getattr(ddp, "_comm_hooks", None)
    return hooks[0][1] if hooks else None


def _count_flops_overridable() -> bool:
    from torch.utils.flop_counter import FlopCounterMode

    return callable(getattr(FlopCounterMode, "_count_flops", None))


class RecomputeFlopCounter:
    """``torch.utils.flop_counter.FlopCounterMode`` that also counts the FLOPs activation checkpointing recomputes.

    Backward formulas run with grad mode off; a checkpointed region's forward, replayed during backward (reentrant
    or not, ours, torch's ``checkpoint_wrapper`` or a model's own ``torch.utils.checkpoint`` calls), runs with it on.
    So an operation counted after :meth:`start_backward` with grad enabled is recomputation. Overrides the private
    ``FlopCounterMode._count_flops`` (torch >= 2.4); where that is missing, :attr:`recomputed` stays ``None``.

    Example::

        counter = RecomputeFlopCounter()
        with counter:
            loss = model(x).sum()
            counter.start_backward()
            loss.backward()
        counter.total, counter.forward, counter.recomputed
    """

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        supported = _count_flops_overridable()
        owner = self

        class _Mode(FlopCounterMode):
            def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
                before = self.get_total_flops() if owner._in_backward else 0
                result = super()._count_flops(func_packet, out, args, kwargs)  # type: ignore[misc]
                if owner._in_backward and torch.is_grad_enabled():
                    owner._recomputed += self.get_total_flops() - before
                return result

        self._mode = (_Mode if supported else FlopCounterMode)(display=False)
        self._supported = supported
        self._in_backward = False
        self._forward = 0
        self._recomputed = 0

    def __enter__(self) -> RecomputeFlopCounter:
        self._in_backward, self._forward, self._recomputed = False, 0, 0
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        if not self._in_backward:
            self._forward = self.total
        return self._mode.__exit__(*exc)

    def start_backward(self) -> None:
        """Mark the end of the forward pass: what is counted from here on is backward (and recomputation)."""
        self._forward = self.total
        self._in_backward = True

    @property
    def total(self) -> int:
        """Every FLOP counted: forward, backward and recomputation (hardware FLOPs)."""
        return int(self._mode.get_total_flops())

    @property
    def forward(self) -> int:
        """FLOPs of the forward pass (before :meth:`start_backward`; all of them if it was never called)."""
        return self._forward

    @property
    def recomputed(self) -> int | None:
        """FLOPs recomputed by activation checkpointing during backward; ``None`` where torch cannot tell."""
        return self._recomputed if self._supported else None


class MetaTruthValues:
    """Inside it, reading the truth value of a one-element boolean meta tensor (``bool(t)``, ``t.item()``,
    ``if mask.all():``) gives ``True`` instead of raising "Tensor.item() cannot be called on meta tensors".

    For counting FLOPs on meta tensors a forward whose code asks a yes/no question of its inputs' values: Hugging
    Face's mask code asks whether every token of a padding mask is real, and whether position ids hold packed
    sequences, to pick a faster path that runs the same matrix products. Reads of other values (``int(mask.sum())``)
    still raise. A ``torch.utils._python_dispatch.TorchDispatchMode``; ``reads`` counts the answers given.

    Example::

        with FlopCounterMode(), MetaTruthValues() as truth:
            model_on_meta(**meta_batch)
    """

    def __init__(self, fake: bool = False) -> None:
        """``fake``: answer for the fake tensors of a ``FakeTensorMode`` entered before this mode as well (the
        planner's activation measurement), where a read raises ``DataDependentOutputException``."""
        from torch.utils._python_dispatch import TorchDispatchMode

        owner = self
        scalar = torch.ops.aten._local_scalar_dense.default

        def answered(t: Any) -> bool:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
                return False
            return t.is_meta or (fake and type(t).__name__ == "FakeTensor")

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                t = args[0] if args else None
                if func is scalar and answered(t):
                    owner.reads += 1
                    return True
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self.reads = 0

    def __enter__(self) -> MetaTruthValues:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._mode.__exit__(*exc)


@contextlib.contextmanager
def builtin_linear() -> Iterator[None]:
    """Inside it, ``torch.nn.functional.linear`` is torch's own again where DeepSpeed ZeRO-3 replaced it.

    ZeRO-3 swaps it, process-wide and for the whole run, for ``zero3_linear_wrap``, an autograd ``Function`` whose
    forward runs with grad mode off; a FLOP count on a meta copy would then take the forward that activation
    checkpointing replays for backward work (see :class:`RecomputeFlopCounter`). Any other replacement is kept.
    """
    functional = torch.nn.functional
    current = functional.linear
    builtin = getattr(torch._C._nn, "linear", None)
    if builtin is None or current is builtin or not getattr(current, "__module__", "").startswith("deepspeed."):
        yield
        return
    functional.linear = builtin
    try:
        yield
    finally:
        functional.linear = current


def restore_builtin_linear() -> bool:
    """Put torch's own ``torch.nn.functional.linear`` back where DeepSpeed ZeRO-3 left its ``zero3_linear_wrap``.

    ``zero.Init`` swaps it process-wide and leaves it swapped after the job (deepspeed 0.19). A sweep runs its jobs
    in one rank-0 process, so every job after a ZeRO-3 one would train (and measure its activations) with DeepSpeed's
    linear, which saves other tensors under autocast. Returns whether it restored anything.
    """
    functional = torch.nn.functional
    builtin = getattr(torch._C._nn, "linear", None)
    current = functional.linear
    if builtin is None or current is builtin or not getattr(current, "__module__", "").startswith("deepspeed."):
        return False
    functional.linear = builtin
    return True


def is_compiled(module: torch.nn.Module) -> bool:
    """``module`` or a submodule runs through ``torch.compile``: ``torch.compile(inner)`` assigned as a child (LitGPT's
    ``compile_model``), ``nn.Module.compile()``, or ``torch.compile(lightning_module)`` given to ``fit`` (Lightning
    unwraps it and keeps ``_compiler_ctx``). These are private attributes: on a torch that renames them the detection
    is lost and the verdict merely keeps its compile advice."""
    if getattr(module, "_compiler_ctx", None):
        return True
    optimized = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "OptimizedModule", None)
    return any(
        (optimized is not None and isinstance(m, optimized)) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def extension_build_dir(name: str) -> str:
    """Where ``torch.utils.cpp_extension.load(name=...)`` builds and caches a JIT extension (``_get_build_directory``).

    Honours ``TORCH_EXTENSIONS_DIR``; falls back to the public default root when the private helper is gone.
    """
    import os

    from torch.utils import cpp_extension

    get = getattr(cpp_extension, "_get_build_directory", None)
    if get is not None:
        return str(get(name, False))
    return os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(), name)


@contextlib.contextmanager
def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run code with some of ``module``'s parameters replaced by other tensors (``torch.func.functional_call``'s
    private context, ``torch.nn.utils.stateless._reparametrize_module``), without calling the module: its hooks do
    not run again. Names are relative to ``module``; the originals are back afterwards, also on an error.

    Raises:
        RuntimeError: this torch no longer has the private context.
    """
    from torch.nn.utils import stateless

    context = getattr(stateless, "_reparametrize_module", None)
    if context is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.utils.stateless._reparametrize_module, which fp32-kept modules "
            "with half-precision parameters need; run them under a mixed preset whose parameters stay fp32."
        )
    with context(module, tensors):
        yield


#: The torch versions the wrappers below were written and tested against: ``[low, high)``.
TORCH_RANGE = ("2.4", "2.14")


def _torch_changed(what: str) -> UpstreamChangedError:
    return changed("torch", what, *TORCH_RANGE, "torch_internals")


def fake_tensor_mode() -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode``: tensors with shapes, dtypes and storages, no data."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as err:
        raise _torch_changed("torch._subclasses.fake_tensor.FakeTensorMode") from err
    return FakeTensorMode()


def replace_own_tensors(module: torch.nn.Module, replace: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Swap each parameter and buffer ``module`` itself holds (not its children's) for ``replace(tensor)``.

    Writes ``nn.Module._parameters``/``_buffers`` directly: ``setattr`` would refuse a plain tensor in place of a
    parameter and re-register buffers, and the swap must keep each entry's kind and position.
    """
    params = private_attr(module, "_parameters", "torch", *TORCH_RANGE, "torch_internals")
    buffers = private_attr(module, "_buffers", "torch", *TORCH_RANGE, "torch_internals")
    for key, p in params.items():
        if p is not None:
            params[key] = replace(p)
    for key, b in buffers.items():
        if b is not None:
            buffers[key] = replace(b)


def own_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """``module``'s own parameter slots, the live dict (``nn.Module._parameters``): writing to it re-points a slot
    without ``register_parameter``'s checks, as the meta build's whole-parameter stand-ins and re-tying need."""
    return private_attr(module, "_parameters", "torch", *TORCH_RANGE, "torch_internals")  # type: ignore[no-any-return]


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``: the counter torch bumps at each in-place write (autograd checks saved tensors with it)."""
    return int(private_attr(t, "_version", "torch", *TORCH_RANGE, "torch_internals"))


def tensor_base(t: torch.Tensor) -> torch.Tensor | None:
    """``t._base``: the tensor ``t`` is a view of, ``None`` for a tensor that owns its storage."""
    base = private_attr(t, "_base", "torch", *TORCH_RANGE, "torch_internals")
    return base if isinstance(base, torch.Tensor) else None


def pre_fsdp_class(cls: type) -> type:
    """The module class before FSDP2's ``fully_shard`` swapped it for its ``FSDP<Name>`` subclass, else ``cls``.

    ``fully_shard`` records the original's position in the new class's MRO as ``_orig_cls_mro_index``.
    """
    index = getattr(cls, "_orig_cls_mro_index", None)
    return cls.__mro__[index] if isinstance(index, int) else cls


def has_compiled_call(module: torch.nn.Module) -> bool:
    """``module.compile()`` was called on this module itself (``nn.Module._compiled_call_impl`` is set)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_original(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), else ``module`` itself."""
    original = getattr(module, "_orig_mod", module)
    return original if isinstance(original, torch.nn.Module) else module


def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor, as 0-d tensors in its dtype and on its device (``torch._foreach_norm``).

    One call for the whole list: a fused kernel per device and dtype on CUDA, one C++ loop on CPU, no Python loop
    over the tensors. It is what ``torch.nn.utils.get_total_norm`` computes before it combines the norms.
    """
    norm = private_attr(torch, "_foreach_norm", "torch", *TORCH_RANGE, "torch_internals")
    return list(norm(tensors))


def local_box(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's piece of the DTensor ``param``, for any placements on any mesh
    (FSDP2's ``Shard``, its ``_StridedShard`` under tensor parallelism, TP's ``Shard``/``Replicate``, HSDP's 3-D mesh).

    torch's ``compute_local_shape_and_global_offset`` (what DCP plans its reads with) lives in the private
    ``torch.distributed.tensor._utils``; an uneven split gives the unpadded size of this rank's piece (0 past the end).
    """
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as err:  # pragma: no cover - depends on the torch release
        raise _torch_changed("torch.distributed.tensor._utils.compute_local_shape_and_global_offset") from err
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(int(n) for n in shape), tuple(int(n) for n in offset)


def head_colwise_parallel(**kwargs: Any) -> Any:
    """``ColwiseParallel(**kwargs)`` for an output head whose call may return a loss instead of logits.

    A head loss computed inside the head's call (``loss=chunked_ce`` under tensor parallelism, which reduces the
    vocabulary shards itself) returns a plain scalar; ColwiseParallel's output hook would read its ``placements``
    and redistribute it to ``Shard(-1)``. Here a plain tensor passes the hook unchanged, DTensor logits go through
    torch's own hook. Overrides the private static ``ColwiseParallel._prepare_output_fn``.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    own = private_attr(ColwiseParallel, "_prepare_output_fn", "torch", *TORCH_RANGE, "torch_internals")

    def prepare_output(output_layouts: Any, use_local_output: bool, mod: Any, outputs: Any, device_mesh: Any) -> Any:
        if not isinstance(outputs, DTensor):
            return outputs  # the head loss's scalar, already the same on every rank of the group
        return own(output_layouts, use_local_output, mod, outputs, device_mesh)

    style = type("HeadColwiseParallel", (ColwiseParallel,), {"_prepare_output_fn": staticmethod(prepare_output)})
    return style(**kwargs)


def collective_result(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for torch's ``AsyncCollectiveTensor`` the plain tensor it wraps, waited for.

    A DTensor redistributed and handed on as a local tensor (tensor parallelism's ``use_local_output=True``) is the
    pending result of a functional collective: a wrapper subclass without storage of its own, which autograd saves
    as it is. Its class lives in the private ``torch.distributed._functional_collectives``.
    """
    if not torch.distributed.is_available():
        return t
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError as err:  # pragma: no cover - depends on the torch release
        raise _torch_changed("torch.distributed._functional_collectives.AsyncCollectiveTensor") from err
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t
