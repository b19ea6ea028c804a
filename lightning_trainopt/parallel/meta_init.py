"""Materialise a model built on the ``meta`` device and sharded by FSDP2, with the values an eager build draws.

A rank then never holds the whole model: ``fully_shard`` runs on meta parameters (shapes only), ``to_empty`` gives
each rank storage for its own shards, and the model's init is replayed one module at a time, each parameter drawn
whole into a temporary (the random numbers must be drawn in the eager build's order to give its values) of which the
rank keeps only its rows.

The replay follows what building the model eagerly does to the CPU generator, from the generator state the build
started from (the same seed gives the same weights as a build without meta, on any device, because an eager FSDP2
build also draws on the CPU: Lightning's ``ModelParallelStrategy`` gives ``configure_model`` no device):

1. construction: each module that holds parameters itself runs its ``reset_parameters()`` (``nn.Linear``'s kaiming
   uniform, ``nn.Embedding``'s normal, a norm's ones), in ``modules()`` order, i.e. the order ``__init__`` built them;
2. the owner's init: the outermost module with a per-module ``_init_weights(module)`` (our ``GPT``) calls it for each
   of its modules in ``modules()`` order, each shared (tied) parameter once, as ``GPT.reset_parameters`` does.

Host memory: a parameter that step 2 rewrites is not written in step 1 (its draw only advances the generator, into a
temporary), so untouched shard pages stay unmapped until step 2 writes them; the peak is the shards plus one whole
parameter (the embedding). Which parameters step 2 rewrites is found by a dry run on the meta device (an in-place
init bumps the tensor's version counter); a parameter step 2 writes is taken as wholly rewritten by it (true of
``normal_``-style inits; the equality test of ``tests/unit/parallel/test_meta_init.py`` checks it for our GPT).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_trainopt._compat.torch_internals import own_parameters, tensor_version
from lightning_trainopt.transforms.blocks import own_class

__all__ = ["has_meta_tensors", "materialize_sharded", "owner_of_init"]


def has_meta_tensors(module: nn.Module) -> bool:
    """``module`` has a parameter or buffer on the ``meta`` device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def owner_of_init(root: nn.Module) -> nn.Module | None:
    """The outermost module of ``root`` with a per-module ``_init_weights`` that is not a torch class, or ``None``."""
    for module in root.modules():
        # own_class: FSDP2 swaps a sharded module's class for a generated ``FSDP<Name>`` defined in torch.
        if callable(getattr(module, "_init_weights", None)) and own_class(module).__module__.split(".")[0] != "torch":
            return module
    return None


def _local_rows(param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """For an FSDP2 ``DTensor`` sharded on one dim: the function that cuts this rank's piece out of a whole tensor
    (``torch.chunk`` along that dim, as ``fully_shard`` splits); for a plain tensor: the whole tensor."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return lambda whole: whole
    mesh = param.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard():
        raise NotImplementedError(f"meta init handles a 1-D mesh with one Shard placement, not {placements} on {mesh}")
    dim, world, rank = placements[0].dim, mesh.size(), mesh.get_local_rank()

    def cut(whole: torch.Tensor) -> torch.Tensor:
        chunks = torch.chunk(whole, world, dim=dim)
        return chunks[rank] if rank < len(chunks) else whole.narrow(dim, 0, 0)

    return cut


def _local(param: torch.Tensor) -> torch.Tensor:
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param  # type: ignore[no-any-return]


@contextmanager
def _whole_params(module: nn.Module, device: torch.device | str) -> Iterator[dict[str, nn.Parameter]]:
    """While inside, ``module``'s own parameters are whole plain tensors on ``device`` (uninitialised)."""
    own = dict(own_parameters(module))
    temps = {
        name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for name, p in own.items()
        if p is not None
    }
    own_parameters(module).update(temps)
    try:
        yield temps
    finally:
        own_parameters(module).update(own)


def _rewritten_by_owner(owner: nn.Module, order: list[nn.Module]) -> set[int]:
    """``id()`` of the parameters the owner's ``_init_weights`` writes, found by running it on meta stand-ins."""
    written: set[int] = set()
    for module in order:
        own = {name: p for name, p in own_parameters(module).items() if p is not None}
        with _whole_params(module, "meta") as temps, torch.no_grad():
            before = {name: tensor_version(t) for name, t in temps.items()}
            owner._init_weights(module)  # type: ignore[operator]
            written.update(id(own[name]) for name, t in temps.items() if tensor_version(t) != before[name])
    return written


def _owner_order(owner: nn.Module) -> list[nn.Module]:
    """The modules whose own parameters the owner initialises, in its order, each shared parameter once."""
    seen: set[int] = set()
    order = []
    for module in owner.modules():
        own = list(module.parameters(recurse=False))
        if any(id(p) not in seen for p in own):
            order.append(module)
        seen.update(id(p) for p in own)
    return order


def materialize_sharded(root: nn.Module, device: torch.device, rng_state: torch.Tensor | None = None) -> int:
    """Give every meta parameter of ``root`` storage on ``device`` and the values an eager build would draw.

    Call after ``fully_shard`` (each rank then allocates and writes only its shards) or on an unsharded model.
    Buffers on the meta device are refused: nothing says how to fill them.

    Args:
        root: the LightningModule (or any module) whose model was built under ``torch.device("meta")``.
        device: where the shards live (the accelerator, or the CPU under ``CPUOffloadPolicy``).
        rng_state: the CPU generator state the meta build started from (``torch.get_rng_state()``); the replay
            draws from it. ``None``: from the current state.

    Returns:
        the number of parameters materialised.

    Raises:
        NotImplementedError: a meta buffer, a parameter that neither its module's ``reset_parameters`` nor an
            owner's ``_init_weights`` initialises, or a sharding other than FSDP2's 1-D ``Shard``.
    """
    metas = [m for m in root.children() if has_meta_tensors(m)]
    if not metas:
        return 0
    meta_buffers = [name for name, b in root.named_buffers() if b.is_meta]
    if meta_buffers:
        raise NotImplementedError(f"meta init cannot fill the buffers {meta_buffers[:4]}; build them off meta")
    # Storage first: to_empty swaps the parameter objects, so everything below is read after it. It also unties
    # shared (tied) parameters of plain modules: they are tied again as they were.
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in own_parameters(module).items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    for m in metas:
        m.to_empty(device=device)
    for (first, first_name), *others in (group for group in slots.values() if len(group) > 1):
        for module, name in others:
            own_parameters(module)[name] = own_parameters(first)[first_name]
    params = {id(p) for m in metas for p in m.parameters()}
    owner = owner_of_init(root)
    order = _owner_order(owner) if owner is not None else []
    rewritten = _rewritten_by_owner(owner, order) if owner is not None else set()
    missing = [
        f"{name} ({type(m).__name__})"
        for name, m in root.named_modules()
        if any(id(p) in params for p in m.parameters(recurse=False))
        and not callable(getattr(m, "reset_parameters", None))
        and not all(id(p) in rewritten for p in m.parameters(recurse=False))
    ]
    if missing:
        raise NotImplementedError(f"meta init: nothing initialises the parameters of {missing[:4]}")
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    host = torch.device("cpu")
    done: set[int] = set()

    def replay(module: nn.Module, init: Callable[[], None], keep: Callable[[nn.Parameter], bool]) -> None:
        own = {name: p for name, p in own_parameters(module).items() if p is not None}
        with _whole_params(module, host) as temps, torch.no_grad():
            init()
            for name, temp in temps.items():
                if keep(own[name]):
                    _local(own[name]).copy_(_local_rows(own[name])(temp))
                    done.add(id(own[name]))

    with torch.no_grad():
        for module in root.modules():
            own = list(module.parameters(recurse=False))
            reset = getattr(module, "reset_parameters", None)
            if own and any(id(p) in params for p in own) and callable(reset):
                replay(module, reset, lambda p: id(p) not in rewritten)
        init_weights: Callable[[nn.Module], None] = getattr(owner, "_init_weights", lambda _m: None)
        for module in order:
            replay(module, functools.partial(init_weights, module), lambda p: id(p) in rewritten)
    return len(done)
