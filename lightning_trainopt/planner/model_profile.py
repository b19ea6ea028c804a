"""What the planner knows about a model, as one plain value: :class:`ModelProfile`.

Two producers make it, and the planner reads nothing else about the model:

- :func:`gpt_profile`: our demo transformer, analytically from its :class:`GPTConfig` (param groups, ZeRO-3 trace,
  FSDP2 units, activations derived op by op, FLOPs by formula);
- :func:`module_profile`: any ``nn.Module``, read from the module itself (built on the meta device, so a 70B model
  costs no memory): parameter element counts per optimizer group and per FSDP2 unit, tied weights once, the
  ZeRO-3 gather trace from one forward's module order; activations and FLOPs come from callables the caller measures
  with (fake tensors, ``torch.utils.flop_counter``), called lazily for each configuration the planner asks about.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from lightning_trainopt.metrics.flops import transformer_flops
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner.activations import ActivationPolicy, estimate_transformer_activations
from lightning_trainopt.planner.fsdp_units import FSDPUnits, gpt_fsdp_units
from lightning_trainopt.planner.precision_plan import LossPlan
from lightning_trainopt.planner.terms import MemoryEstimate
from lightning_trainopt.planner.tp_shape import TPShape
from lightning_trainopt.planner.zero3_gather import gpt_module_trace

__all__ = [
    "ActivationsFn",
    "FlopsFn",
    "ModelProfile",
    "decay_groups",
    "forward_trace",
    "gpt_param_groups",
    "gpt_profile",
    "module_profile",
]

ModuleTrace = tuple[tuple[tuple[int, int], ...], ...]
#: ``(micro_batch, seq_len, compute_bytes, autocast, policy, attention) -> MemoryEstimate`` of the activations (and
#: their backward-time transients) of one micro-batch on one device.
ActivationsFn = Callable[[int, int, int, bool, ActivationPolicy, str], MemoryEstimate]
#: ``(micro_batch, seq_len) -> (model FLOPs of forward + backward, forward FLOPs recomputed when every block is
#: checkpointed)``.
FlopsFn = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True, eq=False)
class ModelProfile:
    """A model as the planner sees it.

    Args:
        name: for reports (the preset name, or the model's class).
        param_groups: element counts of the trainable parameters, one tuple per optimizer param group (matrices
            decayed, 1-D not), each shared parameter once.
        module_trace: forward order of the parameter-owning modules, ``((param_id, numel), ...)`` per execution
            (``zero3_gather``): which parameters ZeRO-3 holds gathered.
        fsdp_units: FSDP2's units.
        n_blocks: repeated blocks that activation checkpointing can wrap.
        activations: see :data:`ActivationsFn`.
        flops: see :data:`FlopsFn`.
        max_seq_len: longest sequence the model takes (``None`` when it does not say).
        tied_numel: elements of parameters used by more than one module (a tied embedding), counted once.
        measured: activations and FLOPs are measured on the module (fake tensors, flop counter), not derived.
        block_class: class name of the repeated block (``Block``, ``LlamaDecoderLayer``; empty when none).
        tp_shape: what a tensor-parallel plan splits (``None``: the model has no plan, the planner refuses TP).
        tp_split: per parameter of ``param_groups``, whether TP splits it; ``None``: the matrices (the first group)
            split, the vectors whole (our GPT, Llama without biases).

    Example::

        profile = gpt_profile(GPTConfig(name="tiny", vocab_size=256, n_layers=2, d_model=64, n_heads=4))
        profile.n_params
    """

    name: str
    param_groups: tuple[tuple[int, ...], ...]
    module_trace: ModuleTrace
    fsdp_units: FSDPUnits
    n_blocks: int
    activations: ActivationsFn
    flops: FlopsFn
    max_seq_len: int | None = None
    tied_numel: int = 0
    measured: bool = False
    block_class: str = ""
    tp_shape: TPShape | None = None
    tp_split: tuple[tuple[bool, ...], ...] | None = None

    @property
    def n_params(self) -> int:
        """Trainable parameters, each shared one once."""
        return sum(sum(g) for g in self.param_groups)


def gpt_param_groups(cfg: GPTConfig) -> list[list[int]]:
    """Element counts of :class:`~lightning_trainopt.models.GPT`'s parameters as ``LitGPT.param_groups`` splits them.

    Returns:
        ``[matrices (weight decay), vectors (no decay)]``; a tied embedding counted once.
    """
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    block = [d * d, d * kv, d * kv, d * d, d * cfg.ffn_hidden, d * cfg.ffn_hidden, cfg.ffn_hidden * d]
    matrices = [cfg.vocab_size * d] + block * cfg.n_layers
    if not cfg.tie_embeddings:
        matrices.append(cfg.vocab_size * d)
    return [matrices, [d] * (2 * cfg.n_layers + 1)]


@lru_cache(maxsize=64)
def gpt_profile(cfg: GPTConfig, loss: LossPlan | None = None) -> ModelProfile:
    """The analytic profile of our demo transformer (``models/gpt.py``), with the loss that follows its head
    (``None``: logits and ``F.cross_entropy``)."""
    kv = cfg.kv_heads * cfg.head_dim
    shape = (cfg.vocab_size, cfg.d_model, kv, cfg.ffn_hidden, cfg.n_layers, cfg.tie_embeddings)

    def activations(
        micro_batch: int, seq_len: int, compute_bytes: int, autocast: bool, policy: ActivationPolicy, attention: str
    ) -> MemoryEstimate:
        return estimate_transformer_activations(
            cfg, micro_batch, seq_len, compute_bytes, autocast, policy, attention, loss
        )

    def flops(micro_batch: int, seq_len: int) -> tuple[int, int]:
        f = transformer_flops(cfg, seq_len, micro_batch)
        return f.train, f.block_recompute

    return ModelProfile(
        name=cfg.name,
        param_groups=tuple(tuple(g) for g in gpt_param_groups(cfg)),
        module_trace=gpt_module_trace(*shape),
        fsdp_units=gpt_fsdp_units(*shape),
        n_blocks=cfg.n_layers,
        activations=activations,
        flops=flops,
        max_seq_len=cfg.max_seq_len,
        tied_numel=cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0,
        block_class="Block",
        tp_shape=TPShape("gpt", cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.ffn_hidden, cfg.vocab_size, cfg.n_layers),
    )


def _numel(p: torch.Tensor) -> int:
    # A ZeRO-3 placeholder keeps its real shape in ds_shape.
    shape = getattr(p, "ds_shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def _ndim(p: torch.Tensor) -> int:
    return len(getattr(p, "ds_shape", p.shape))


def decay_groups(params: Iterable[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    """Element counts of the trainable parameters as the app's optimizer groups split them: matrices (>= 2-D, decayed)
    then the rest (1-D, not decayed); frozen parameters left out, each parameter once, empty groups dropped
    (``models.optimization.decay_param_groups``, ``LitGPT.param_groups``)."""
    seen: set[int] = set()
    decay: list[int] = []
    no_decay: list[int] = []
    for p in params:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if _ndim(p) >= 2 else no_decay).append(_numel(p))
    return tuple(tuple(g) for g in (decay, no_decay) if g)


def _decay_split(params: Iterable[torch.Tensor], sharded: Collection[int]) -> tuple[tuple[bool, ...], ...]:
    """Whether each parameter of :func:`decay_groups` (same order) is in ``sharded`` (ids of what TP splits)."""
    seen: set[int] = set()
    decay: list[bool] = []
    no_decay: list[bool] = []
    for p in params:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if _ndim(p) >= 2 else no_decay).append(id(p) in sharded)
    return tuple(tuple(g) for g in (decay, no_decay) if g)


def _param_index(module: nn.Module) -> dict[int, int]:
    """``id(parameter) -> index`` of the module's trainable parameters, each shared one once."""
    index: dict[int, int] = {}
    for p in module.parameters():
        if p.requires_grad:
            index.setdefault(id(p), len(index))
    return index


def forward_trace(module: nn.Module, run: Callable[[], object]) -> ModuleTrace:
    """The order in which ``run()`` (one forward of ``module``) executes its parameter-owning modules.

    Returns:
        one entry per module execution: ``((param_id, numel), ...)`` of its own trainable parameters (not its
        children's), ``param_id`` the parameter's index in ``module.parameters()``, so a parameter shared by several
        modules (a tied embedding) has one id: what DeepSpeed ZeRO-3 fetches module by module (``zero3_gather``).
    """
    index = _param_index(module)
    trace: list[tuple[tuple[int, int], ...]] = []

    def hook(mod: nn.Module, *_: object) -> None:
        own = [(index[id(p)], _numel(p)) for p in mod.parameters(recurse=False) if id(p) in index]
        if own:
            trace.append(tuple(own))

    owners = [m for m in module.modules() if any(id(p) in index for p in m.parameters(recurse=False))]
    handles = [m.register_forward_pre_hook(hook) for m in owners]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return tuple(trace)


def _fsdp_units(module: nn.Module, block_classes: Sequence[str], trace: ModuleTrace) -> tuple[FSDPUnits, str]:
    """FSDP2's units of ``module`` as ``parallel.fsdp.apply_fully_shard`` makes them: each module of a block class
    its own unit (outermost first; a parameter in the first unit that holds it), the parameters outside every block
    the root. The head is the root parameters of the last module in the forward trace that owns any: backward makes
    their gradient first, and the root unit reduces it only after backward."""
    index = _param_index(module)
    in_block: set[int] = set()
    blocks: list[int] = []
    names = set(block_classes)
    found = ""
    for m in module.modules():
        if m is module or type(m).__name__ not in names:
            continue
        own = {index[id(p)]: _numel(p) for p in m.parameters() if id(p) in index and index[id(p)] not in in_block}
        if not own:
            continue
        in_block.update(own)
        blocks.append(sum(own.values()))
        found = found or type(m).__name__
    numel = {index[id(p)]: _numel(p) for p in module.parameters() if id(p) in index}
    root = sum(n for i, n in numel.items() if i not in in_block)
    head = 0
    for mod in reversed(trace):
        outside = [n for i, n in mod if i not in in_block]
        if outside:
            head = sum(outside)
            break
    return FSDPUnits(blocks=tuple(blocks), root=root, head=head), found


def _tied_numel(module: nn.Module) -> int:
    """Elements of trainable parameters that more than one module holds (each counted once in the groups)."""
    owners: dict[int, tuple[int, int]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if p.requires_grad:
                count, n = owners.get(id(p), (0, _numel(p)))
                owners[id(p)] = (count + 1, n)
    return sum(n for count, n in owners.values() if count > 1)


def module_profile(
    module: nn.Module,
    name: str,
    activations: ActivationsFn,
    flops: FlopsFn,
    block_classes: Sequence[str] = (),
    trace: ModuleTrace | None = None,
    max_seq_len: int | None = None,
    tp_shape: TPShape | None = None,
    tp_sharded: Collection[int] = (),
) -> ModelProfile:
    """The profile of any module, read from its parameters (built on the meta device, only shapes are read).

    Args:
        module: the model (a LightningModule holding its inner model, or a plain ``nn.Module``).
        name: for reports.
        activations: measures activations per configuration (see :data:`ActivationsFn`).
        flops: counts FLOPs per micro-batch shape (see :data:`FlopsFn`).
        block_classes: class names of the repeated block (``parallel.fsdp.block_classes``: a Hugging Face model's
            ``_no_split_modules``, else the class of the largest ``ModuleList``); ``()``: none, every parameter in
            the root unit.
        trace: the forward order of parameter-owning modules (:func:`forward_trace`); ``None``: each parameter its
            own module, in registration order.
        max_seq_len: longest sequence the model takes, when it says.
        tp_shape: what the model's tensor-parallel plan splits (``parallel.tp.tp_shape``); ``None``: no plan.
        tp_sharded: ``id`` of each parameter that plan splits (``parallel.tp.tp_sharded_parameters``).
    """
    index = _param_index(module)
    if trace is None:
        trace = tuple(((index[id(p)], _numel(p)),) for p in module.parameters() if id(p) in index)
    units, found = _fsdp_units(module, block_classes, trace)
    return ModelProfile(
        name=name,
        param_groups=decay_groups(module.parameters()),
        module_trace=trace,
        fsdp_units=units,
        n_blocks=len(units.blocks),
        activations=activations,
        flops=flops,
        max_seq_len=max_seq_len,
        tied_numel=_tied_numel(module),
        measured=True,
        block_class=found,
        tp_shape=tp_shape,
        tp_split=_decay_split(module.parameters(), set(tp_sharded)) if tp_shape is not None else None,
    )
