"""Materialise a model built on the ``meta`` device and sharded by FSDP2 and/or tensor parallelism, with the values an
eager build draws, or with each rank's slices of saved weights.

A rank then never holds the whole model: ``parallelize_module`` and ``fully_shard`` run on meta parameters (shapes
only), ``to_empty`` gives each rank storage for its own shards, and the model's build is replayed one module at a
time, each parameter drawn whole into a temporary (the random numbers must be drawn in the eager build's order to
give its values) of which the rank keeps only its piece: for each ``Shard(dim)`` placement of its ``DTensor`` its
slice along ``dim`` (FSDP2's rows; a row-parallel layer's columns under TP), the whole tensor where it is
``Replicate``.

The replay follows what building the model eagerly does to the CPU generator, from the generator state the build
started from (the same seed gives the same weights as a build without meta, on any device, because an eager FSDP2
build also draws on the CPU: Lightning's ``ModelParallelStrategy`` gives ``configure_model`` no device), as
:func:`build_order` lists it:

1. construction: each module that holds parameters itself runs its ``reset_parameters()`` (``nn.Linear``'s kaiming
   uniform, ``nn.Embedding``'s normal, a norm's ones), in ``modules()`` order, i.e. the order ``__init__`` built them;
2. the owner's init: the outermost module with a per-module ``_init_weights(module)`` (our ``GPT``) calls it for each
   of its modules in ``modules()`` order, each shared (tied) parameter once, as ``GPT.reset_parameters`` does.

A Hugging Face model interleaves the two as transformers does (each nested ``PreTrainedModel`` is constructed and
initialised by its own ``post_init`` before its parent goes on; the init walks children first): see
:func:`lightning_trainopt._compat.transformers_internals.build_order`. A tied parameter keeps the value drawn at its
owning slot (the input embedding), as transformers' ``tie_weights`` does after the head drew its own.

With saved weights (:func:`load_sharded`) nothing is drawn: each rank reads its piece of each tensor
(``safetensors`` ``get_slice``), and only buffers the files lack are filled by the model's init.

Host memory: a parameter that step 2 rewrites is not written in step 1 (its draw only advances the generator, into a
temporary), so untouched shard pages stay unmapped until step 2 writes them; the peak is the shards plus one whole
parameter (the embedding). Which parameters step 2 rewrites is found by a dry run on the meta device (an in-place
init bumps the tensor's version counter); a parameter step 2 writes is taken as wholly rewritten by it (true of
``normal_``-style inits; the equality tests of ``tests/unit/parallel/test_meta_init.py`` and ``test_meta_build.py``
check it for our GPT and a Hugging Face Llama).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_trainopt._compat.torch_internals import local_box, own_parameters, tensor_version
from lightning_trainopt._compat.transformers_internals import build_order as hf_build_order
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.blocks import own_class

__all__ = ["build_order", "has_meta_tensors", "load_sharded", "materialize_sharded", "owner_of_init"]


def has_meta_tensors(module: nn.Module) -> bool:
    """``module`` has a parameter or buffer on the ``meta`` device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _has_own_init(module: nn.Module) -> bool:
    """``module`` has a per-module ``_init_weights`` that is not a torch class's."""
    # own_class: FSDP2 swaps a sharded module's class for a generated ``FSDP<Name>`` defined in torch.
    return callable(getattr(module, "_init_weights", None)) and own_class(module).__module__.split(".")[0] != "torch"


def owner_of_init(root: nn.Module) -> nn.Module | None:
    """The outermost module of ``root`` with a per-module ``_init_weights`` that is not a torch class, or ``None``."""
    for module in root.modules():
        if _has_own_init(module):
            return module
    return None


#: This rank's piece of a whole tensor: ``(dim, start, length)`` for each dimension it is cut along.
Piece = tuple[tuple[int, int, int], ...]


def _local_range(param: torch.Tensor) -> Piece | None:
    """For a ``DTensor``: this rank's piece of the whole tensor, ``(dim, start, length)`` per dimension that is cut
    (FSDP2's rows, a tensor-parallel row- or column-parallel layer's rows or columns, both on a 2-D or 3-D mesh; an
    empty piece past the end of an uneven split); ``None`` for a plain tensor (this rank holds it whole).

    The box comes from torch's own placement arithmetic (:func:`~lightning_trainopt._compat.torch_internals.local_box`)
    and is checked against the local tensor's shape, so a placement whose piece is not one box is refused.
    """
    placements = getattr(param, "placements", None)
    if placements is None:
        return None
    shape, offset = local_box(param)
    local = tuple(_local(param).shape)
    if local != shape:
        raise NotImplementedError(
            f"meta init: the piece {shape} at {offset} that {placements} give is not the local shard {local}"
        )
    return tuple(
        (dim, start, length)
        for dim, (whole, start, length) in enumerate(zip(param.shape, offset, shape, strict=True))
        if length != whole
    )


def _local_rows(param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function that cuts this rank's piece of ``param`` out of a whole tensor (the whole tensor if unsharded)."""
    piece = _local_range(param)

    def cut(whole: torch.Tensor) -> torch.Tensor:
        for dim, start, length in piece or ():
            whole = whole.narrow(dim, start, length)
        return whole

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


#: One step of an eager build: ``(module, None)``, the module constructed (its ``reset_parameters`` runs), or
#: ``(module, init)``, the model's own init run as ``init(module)``.
BuildStep = tuple[nn.Module, Callable[[nn.Module], None] | None]


def _rewritten_by_init(order: list[BuildStep]) -> set[int]:
    """``id()`` of the parameters the model's own init writes, found by running it on meta stand-ins."""
    written: set[int] = set()
    for module, init in order:
        if init is None:
            continue
        own = {name: p for name, p in own_parameters(module).items() if p is not None}
        with _whole_params(module, "meta") as temps, torch.no_grad():
            before = {name: tensor_version(t) for name, t in temps.items()}
            init(module)
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


def build_order(root: nn.Module) -> list[BuildStep]:
    """What building ``root``'s model eagerly does to its parameters, in order (what the replay repeats).

    A Hugging Face model: construction and ``post_init``'s ``initialize_weights`` as transformers interleaves them
    (:func:`~lightning_trainopt._compat.transformers_internals.build_order`). Else every module constructed in
    ``modules()`` order, each outermost ``_init_weights`` owner (our ``GPT``) running its init over its modules in
    ``modules()`` order, each shared parameter once, as ``GPT.reset_parameters`` does, right after its own modules
    are constructed (so a second model built after it, a distillation teacher, draws after the student's init, as
    eagerly); without an owner, construction only (a user's modules and their ``reset_parameters``).
    """
    hf = hf_build_order(root)
    if hf:
        return hf
    order: list[BuildStep] = []
    seen: set[int] = set()

    def construct(module: nn.Module, inside_owner: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        order.append((module, None))
        owns = not inside_owner and _has_own_init(module)
        for child in module.children():
            construct(child, inside_owner or owns)
        if owns:
            # The owner initialises its modules when its own construction ends (GPT.__init__ calls
            # reset_parameters), before a module built after it (a distillation teacher beside the student) draws.
            init: Callable[[nn.Module], None] = module._init_weights  # type: ignore[assignment]
            order.extend((m, init) for m in _owner_order(module))

    construct(root, False)
    return order


def _provide_storage(root: nn.Module, metas: list[nn.Module], device: torch.device) -> set[tuple[int, str]]:
    """``to_empty`` the meta-built children, re-tie what was tied; the ``(id(module), name)`` slot that owns each
    parameter's value (the first of a tied group, in ``modules()`` order: the input embedding a head is tied to)."""
    # to_empty swaps the parameter objects, so everything is read after it. It also unties shared (tied) parameters
    # of plain modules: they are tied again as they were.
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
    return {(id(group[0][0]), group[0][1]) for group in slots.values()}


def _read_piece(path: Path, name: str, piece: Piece | None, saved: Mapping[str, Any]) -> Any:
    """This rank's piece of the saved tensor ``name`` (``piece`` as :func:`_local_range` gives it; ``None``: whole).

    A safetensors file is opened for this one tensor: ``get_slice`` reads only the slice's bytes through a memory map,
    and closing the file drops those pages from the rank's RSS, so they never add up over the model. ``saved``: the
    memory-mapped ``torch.load`` of a ``.bin`` file (only the pages of the slice are read).
    """
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            view = f.get_slice(name)
            if piece is None:
                return view[:]
            index = [slice(None)] * len(view.get_shape())
            for dim, start, length in piece:
                index[dim] = slice(start, start + length)
            return view[tuple(index)]
    whole = saved[name]
    for dim, start, length in piece or ():
        whole = whole.narrow(dim, start, length)
    return whole


class _MappedBin(dict):  # type: ignore[type-arg]
    """A ``torch.save`` file's tensors, memory-mapped (nothing read until a slice is copied)."""

    def __init__(self, path: Path) -> None:
        super().__init__(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        self.path = path


def load_sharded(model: nn.Module, files: Mapping[str, Path]) -> set[int]:
    """Copy saved weights into ``model``'s (sharded) parameters and buffers, each rank reading only its slices.

    Names are ``model``'s state-dict names. A tied parameter is read once, under any of its names the files hold (a
    ``save_pretrained`` checkpoint keeps only the input embedding of a tied head); buffers the files lack are left
    (non-persistent ones, such as a rotary embedding's ``inv_freq``, are never saved).

    Args:
        model: built on the meta device, sharded (or not) and given storage (``to_empty``).
        files: ``{tensor name: safetensors or torch.save file}``, e.g. a ``save_pretrained`` directory's index.

    Returns:
        ``id()`` of the parameters and buffers written.

    Raises:
        ConfigError: a parameter or persistent buffer the files lack, or a tensor in the files the model does not
            have (key ``model.pretrained``; every such name listed).
    """
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    persistent = set(model.state_dict(keep_vars=True))
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in persistent or name in files:
            names.setdefault(id(b), []).append(name)
            tensors[id(b)] = b
    known = {name for group in names.values() for name in group}
    missing = [group[0] for group in names.values() if not any(n in files for n in group)]
    unexpected = sorted(set(files) - known)
    if missing or unexpected:
        where = sorted({str(path.parent) for path in files.values()}) or ["(no weights)"]
        raise ConfigError(
            "model.pretrained",
            where[0],
            f"the saved weights do not match the model: missing {len(missing)} {missing[:8]}, unexpected "
            f"{len(unexpected)} {unexpected[:8]}; point it at a save_pretrained directory of this architecture and "
            "config, or set strategy.meta_init=false to load with from_pretrained.",
        )
    # File by file (a .bin file is mapped once); each tensor under the first of its names the files hold.
    chosen = {key: next(n for n in group if n in files) for key, group in names.items()}
    todo = sorted(((files[name], name, key) for key, name in chosen.items()), key=lambda item: (str(item[0]), item[1]))
    saved: Mapping[str, Any] = {}
    with torch.no_grad():
        for path, name, key in todo:
            if path.suffix != ".safetensors" and getattr(saved, "path", None) != path:
                saved = _MappedBin(path)
            t = tensors[key]
            _local(t).copy_(_read_piece(path, name, _local_range(t), saved).to(_local(t).dtype))
    return set(names)


def _refuse(what: str, items: list[str]) -> ConfigError:
    return ConfigError(
        "strategy.meta_init",
        True,
        f"the model was built on the meta device, but nothing initialises the {what} of {items[:4]} (a module's "
        "reset_parameters(), or the _init_weights of the model that holds it); give those modules a "
        "reset_parameters(), or set strategy.meta_init=false to build the whole model on every rank.",
    )


def materialize_sharded(
    root: nn.Module,
    device: torch.device,
    rng_state: torch.Tensor | None = None,
    pretrained: tuple[nn.Module, Mapping[str, Path]] | None = None,
) -> int:
    """Give every meta parameter of ``root`` storage on ``device`` and the values an eager build would draw, or (with
    ``pretrained``) this rank's slices of the saved weights.

    Call after ``fully_shard`` (each rank then allocates and writes only its shards) or on an unsharded model.
    A meta buffer is filled by the model's init (a Hugging Face rotary embedding's ``inv_freq``), by a module's
    ``reset_parameters`` or from ``pretrained``; one that none of them writes is refused.

    Args:
        root: the LightningModule (or any module) whose model was built under ``torch.device("meta")``.
        device: where the shards live (the accelerator, or the CPU under ``CPUOffloadPolicy``).
        rng_state: the CPU generator state the meta build started from (``torch.get_rng_state()``); the replay
            draws from it. ``None``: from the current state.
        pretrained: ``(model, {tensor name: file})``: read the parameters and persistent buffers of ``model`` (a
            module of ``root``, names relative to it) from these safetensors (or ``torch.save``) files, each rank
            only the slices of its shards (:func:`load_sharded`), instead of initialising them.

    Returns:
        the number of parameters materialised.

    Raises:
        ConfigError: a module with meta parameters or buffers that nothing initialises, or parameters with values
            beside meta ones (key ``strategy.meta_init``);
            a saved tensor missing or unexpected (key ``model.pretrained``).
        NotImplementedError: a placement whose local piece is not one box of the whole tensor.
    """
    metas = [m for m in root.children() if has_meta_tensors(m)]
    if not metas:
        return 0
    # to_empty would drop the values of parameters that already have some (loaded with assign=True, or built off
    # the meta device inside configure_model) beside the meta ones.
    valued = [
        f"{name}.{p_name} ({own_class(sub).__name__})"
        for m in metas
        for name, sub in m.named_modules(prefix=next(n for n, c in root.named_children() if c is m))
        for p_name, p in sub.named_parameters(recurse=False)
        if not p.is_meta
    ]
    if valued:
        raise ConfigError(
            "strategy.meta_init",
            True,
            f"{valued[:4]} hold values (loaded, or built off the meta device) beside parameters built on the meta "
            "device, which the shard-by-shard initialisation would overwrite; set strategy.meta_init=false to build "
            "the whole model on every rank.",
        )
    owners = _provide_storage(root, metas, device)
    params = {id(p) for m in metas for p in m.parameters()}
    empty_buffers = {id(b) for m in metas for b in m.buffers()}
    fresh_buffers = {
        (id(module), name): tensor_version(b)
        for module in root.modules()
        for name, b in module.named_buffers(recurse=False)
        if id(b) in empty_buffers
    }
    order = build_order(root)
    done: set[int] = set()
    host = torch.device("cpu")

    def replay(module: nn.Module, init: Callable[[], None], keep: Callable[[str, nn.Parameter], bool]) -> None:
        own = {name: p for name, p in own_parameters(module).items() if p is not None}
        with _whole_params(module, host) as temps, torch.no_grad():
            init()
            for name, temp in temps.items():
                if keep(name, own[name]):
                    _local(own[name]).copy_(_local_rows(own[name])(temp))
                    done.add(id(own[name]))

    if pretrained is not None:
        model, files = pretrained
        loaded = load_sharded(model, files)
        done.update(id(p) for p in model.parameters())
        # What the checkpoint does not hold (a rotary embedding's inv_freq): the model's init fills it; the draws of
        # its parameters go into whole temporaries that are dropped.
        for module, init in order:
            if init is not None and any(id(b) not in loaded for b in module.buffers(recurse=False)):
                replay(module, functools.partial(init, module), lambda _n, _p: False)
    else:
        rewritten = _rewritten_by_init(order)
        missing = [
            f"{name} ({own_class(m).__name__})"
            for name, m in root.named_modules()
            if any(id(p) in params for p in m.parameters(recurse=False))
            and not callable(getattr(m, "reset_parameters", None))
            and not all(id(p) in rewritten for p in m.parameters(recurse=False))
        ]
        if missing:
            raise _refuse("parameters", missing)
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        with torch.no_grad():
            for module, init in order:
                own = list(module.parameters(recurse=False))
                if init is None:
                    # construction: reset_parameters draws also what the init rewrites, into a dropped temporary
                    reset = getattr(module, "reset_parameters", None)
                    if own and any(id(p) in params for p in own) and callable(reset):
                        replay(
                            module,
                            reset,
                            lambda n, p, m=module: id(p) not in rewritten and (id(m), n) in owners,  # type: ignore[misc]
                        )
                else:
                    # the model's init; a tied parameter keeps the value drawn at its owning slot (a head tied to the
                    # input embedding draws its own matrix first, which transformers' tie_weights then drops)
                    replay(
                        module,
                        functools.partial(init, module),
                        lambda n, p, m=module: id(p) in rewritten and (id(m), n) in owners,  # type: ignore[misc]
                    )
    unfilled = [
        f"{name}.{b_name} ({own_class(m).__name__})"
        for name, m in root.named_modules()
        for b_name, b in m.named_buffers(recurse=False)
        if fresh_buffers.get((id(m), b_name)) == tensor_version(b)
    ]
    if unfilled:
        raise _refuse("buffers", unfilled)
    return len(done)
