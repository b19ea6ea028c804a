"""The ordered model rewrite: every change to a built model, applied in one function, in one documented order.

:func:`apply_rewrites` applies what a :class:`RewritePlan` asks for, in this order (torchtitan's
``parallelize_llama`` order; each step says why it sits where it does):

1. **layer conversions** (FP8 linear layers, ``keep_fp32`` modules; adapters join here): they replace or re-wrap
   leaf modules, so every later step must see the final modules: tensor parallelism needs FP8-aware plans, and
   ``fully_shard`` must all-gather torchao's FP8 weight subclass, not a plain weight. LoRA/QLoRA adapters
   (:func:`~lightning_trainopt.transforms.adapters.apply_adapter`) come after the FP8/``keep_fp32`` conversions, so
   peft wraps the layers that will run, and before everything else, so checkpointing, compile and sharding see the
   LoRA layers and the frozen/trainable split.
2. **tensor parallelism** (:func:`~lightning_trainopt.parallel.tp.apply_tensor_parallel`: DTensor plans by module
   name, torchao's float8 plans for converted layers): it follows the conversions (it shards the converted layers)
   and precedes checkpointing (which wraps blocks whose layers are already DTensor-parallel) and compile (which traces
   the DTensor blocks).
3. **activation memory** (checkpointing, then a saved-tensors transform: CPU offload or int8): wraps the blocks'
   ``forward`` on the instance; before compile, so the checkpoint region is traced inside each compiled block.
4. **compile**: one way, per repeated block where the model has one (regional compilation: one graph reused by every
   block), else per parameter-holding child; in place, so parameter names stay.
5. **sharding**: FSDP2 ``fully_shard`` of each block, then each top-level child, last: it shards whatever the steps
   above produced, and FSDP2's per-unit hooks then wrap the compiled, checkpointed blocks. DeepSpeed is a hand-off:
   its engine wraps the model after this function returns.

**Where the app calls it** (``train.py``): from the LightningModule's ``configure_model`` hook
(:func:`rewrite_at_configure_model`), for every strategy (single device, DDP, DeepSpeed ZeRO-1/2/3, FSDP2). Lightning
calls that hook once the module is attached and the strategy's init context is entered (meta device under FSDP2,
``zero.Init`` under ZeRO-3), and before any strategy wraps the model (DDP, the DeepSpeed engine) or shards it
(``TrainOptFSDPStrategy.setup`` runs step 5 after it). The alternatives were weighed: the precision plugin's
``convert_module`` is called by every strategy at the right time, but the app has a plugin of its own only for the FP8
and ``keep_fp32`` presets (Lightning picks the others); each strategy's ``setup`` would be five places (and
Lightning's own single-device and DDP strategies would need subclasses). ``configure_model`` is one hook that every
strategy calls, on any LightningModule (a user's module without one gets the base no-op, wrapped). The FP8/``keep_fp32``
conversion runs there first through the precision plugin (which keeps the report ``PrecisionReport`` reads), except
under ZeRO-3, where converting inside ``zero.Init`` would partition the new layers twice: there it stays in Lightning's
``convert_module`` call right after the hook (a layer swap inside a block is seen by a checkpointed or compiled block,
which looks its children up when it runs). The activation callbacks of ``conf/activations`` are then report-only: they
read :func:`rewrite_report` at ``on_fit_start`` and patch nothing.

A new transform goes where its inputs are final and its outputs are what the later steps expect: something that
swaps modules goes in step 1, something that wraps a block's ``forward`` in step 3.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import SavedTensorsTransform, transform_saved_tensors
from lightning_trainopt.parallel.tp import (
    TPReport,
    apply_tensor_parallel,
    check_teacher_tensor_parallel,
)
from lightning_trainopt.precision.convert import ConversionReport, convert_model
from lightning_trainopt.precision.spec import PrecisionSpec
from lightning_trainopt.transforms.adapters import AdapterReport, AdapterSpec, apply_adapter
from lightning_trainopt.transforms.blocks import block_classes, own_class
from lightning_trainopt.transforms.checkpointing import CheckpointPlan, CheckpointPolicy, apply_activation_checkpointing
from lightning_trainopt.transforms.compile import compile_model

__all__ = [
    "STEPS",
    "RewritePlan",
    "RewriteReport",
    "apply_fully_shard",
    "apply_rewrites",
    "compile_model",
    "planned_rewrite",
    "rewrite_at_configure_model",
    "rewrite_report",
    "with_saved_tensors",
]

#: The steps of :func:`apply_rewrites`, in the order they run.
STEPS = ("convert", "tensor_parallel", "activations", "compile", "shard")

_SAVED_TENSORS_FORWARD = "_trainopt_saved_tensors_forward"
_REPORT = "_trainopt_rewrite_report"
_PLAN = "_trainopt_rewrite_plan"


@dataclass(frozen=True)
class RewritePlan:
    """What :func:`apply_rewrites` applies; every field off by default.

    Args:
        precision: a precision preset that converts layers (FP8) or keeps modules in fp32; ``None``: no conversion.
        emulate_fp8: torchao emulates the FP8 GEMMs in fp32 (on CPU).
        adapter: LoRA/QLoRA adapters (step 1, after the layer conversions: peft wraps the final linear layers);
            ``None`` or ``kind="none"``: none.
        tensor_parallel: tensor-parallel degree; above 1 needs the tensor-parallel mesh (``tp_mesh``) of that size.
        sequence_parallel: under tensor parallelism, split the norms and the residual stream over the sequence too
            (``False``: replicated; the only way FP8 tensor parallelism runs on gloo, see
            :func:`~lightning_trainopt.parallel.tp.apply_tensor_parallel`).
        checkpoint: which blocks to checkpoint; ``None``: none.
        saved_tensors: a transform of the activations saved for backward (``CpuOffloader``, ``Int8Compressor``),
            active during the model's forward.
        compile: ``torch.compile`` per block (else per child).
        compile_kwargs: passed to ``torch.compile``.
        shard: ``fsdp2`` (``fully_shard`` here, with ``mesh``), ``deepspeed`` (the engine wraps later) or ``none``.
        shard_modules: FSDP2 units (class names); ``None``: the model's repeated block.
        cpu_offload: FSDP2's ``CPUOffloadPolicy``.
        reshard_after_forward: FSDP2 frees gathered parameters after forward.
    """

    precision: PrecisionSpec | None = None
    emulate_fp8: bool = False
    adapter: AdapterSpec | None = None
    tensor_parallel: int = 1
    sequence_parallel: bool = True
    checkpoint: CheckpointPolicy | None = None
    saved_tensors: SavedTensorsTransform | None = None
    compile: bool = False
    compile_kwargs: dict[str, Any] = field(default_factory=dict)
    shard: Literal["none", "fsdp2", "deepspeed"] = "none"
    shard_modules: tuple[str, ...] | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True


@dataclass
class RewriteReport:
    """What :func:`apply_rewrites` did, step by step (``steps`` lists the steps that changed the model, in order)."""

    steps: list[str] = field(default_factory=list)
    conversion: ConversionReport | None = None
    adapter: AdapterReport | None = None
    tensor_parallel: TPReport | None = None
    checkpoint: CheckpointPlan | None = None
    compiled: list[str] = field(default_factory=list)
    sharded: int = 0


def with_saved_tensors(model: nn.Module, transform: SavedTensorsTransform) -> None:
    """Run ``model``'s forward under ``transform`` (activation offload or int8), on the instance. Idempotent.

    A LightningModule's ``training_step`` is wrapped rather than its ``forward``: a step may call its inner model
    directly, and every strategy (DDP's and DeepSpeed's wrappers too) calls the instance's ``training_step``.
    Evaluation steps run without grad and save nothing, so they need no transform.

    The unpack hook is stored with each saved tensor when it is packed, so the transform only needs to be active
    while the forward saves them; backward unpacks them wherever it runs.
    """
    if _SAVED_TENSORS_FORWARD in model.__dict__:
        return
    method = "training_step" if callable(getattr(model, "training_step", None)) else "forward"
    own = getattr(model, method)
    model.__dict__[_SAVED_TENSORS_FORWARD] = own

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        context: AbstractContextManager[Any] = transform_saved_tensors(transform)
        with context:
            return own(*args, **kwargs)

    setattr(model, method, types.MethodType(forward, model))


def apply_rewrites(model: nn.Module, plan: RewritePlan, mesh: Any = None, tp_mesh: Any = None) -> RewriteReport:
    """Apply ``plan`` to ``model`` in place, in the order of :data:`STEPS` (see the module docstring for why).

    Args:
        model: the LightningModule (or any module) with its model built, on the meta device or not.
        plan: what to apply.
        mesh: the data-parallel device mesh, for ``plan.shard == "fsdp2"``.
        tp_mesh: the tensor-parallel device mesh, for ``plan.tensor_parallel > 1``.

    Raises:
        ConfigError: ``tensor_parallel`` above 1 without a tensor-parallel mesh of that size, FSDP2 without a mesh,
            or a transform's own refusal.
        IncompatibleConfigError: a model without a tensor-parallel plan, or one whose sizes the degree does not
            divide.
    """
    report = RewriteReport()
    if plan.precision is not None:
        report.conversion = convert_model(model, plan.precision, emulate=plan.emulate_fp8, fsdp=plan.shard == "fsdp2")
        report.steps.append("convert")
    if plan.adapter is not None and plan.adapter.enabled:
        report.adapter = apply_adapter(model, plan.adapter)
        if "convert" not in report.steps:
            report.steps.append("convert")
    if plan.tensor_parallel != 1:
        report.tensor_parallel = _tensor_parallel(
            model, plan.tensor_parallel, tp_mesh, plan.sequence_parallel, compiled=bool(plan.compile)
        )
        report.steps.append("tensor_parallel")
    if plan.checkpoint is not None:
        report.checkpoint = apply_activation_checkpointing(model, plan.checkpoint)
        report.steps.append("activations")
    if plan.saved_tensors is not None:
        with_saved_tensors(model, plan.saved_tensors)
        if "activations" not in report.steps:
            report.steps.append("activations")
    if plan.compile:
        report.compiled = compile_model(model, **plan.compile_kwargs)
        report.steps.append("compile")
    if plan.shard == "fsdp2":
        report.sharded = _fully_shard(model, plan, mesh)
        report.steps.append("shard")
    return report


def rewrite_report(module: nn.Module) -> RewriteReport | None:
    """What :func:`rewrite_at_configure_model` applied to ``module``, ``None`` before it ran (or without it)."""
    report = module.__dict__.get(_REPORT)
    return report if isinstance(report, RewriteReport) else None


def rewrite_at_configure_model(module: Any, plan: RewritePlan) -> None:
    """Apply ``plan`` (steps 1-4; ``plan.shard`` must be ``none``) to the LightningModule ``module`` at the end of its
    ``configure_model``, on the instance (see the module docstring for why this hook).

    Once per module: Lightning calls ``configure_model`` again for each ``validate``/``test`` after ``fit``, and the
    model is already rewritten then. The report is kept on the module (:func:`rewrite_report`).

    Raises:
        ConfigError: ``plan.shard`` is not ``none`` (sharding is the strategy's step 5).
    """
    if plan.shard != "none":
        raise ConfigError("plan.shard", plan.shard, "sharding is the strategy's step; give shard='none' here.")
    module.__dict__[_PLAN] = plan  # read by the strategies before the hook runs (planned_rewrite)
    own = module.configure_model

    def configure_model(self: Any) -> None:
        own()
        if rewrite_report(self) is not None:
            return
        report = RewriteReport()
        converted = _convert_by_plugin(self)
        if converted is not None:
            report.conversion = converted
            report.steps.append("convert")
        tp_mesh = _tp_mesh_of(self)
        tp = 1 if tp_mesh is None else int(tp_mesh.size())
        sp = _sequence_parallel_of(self, plan.sequence_parallel)
        applied = apply_rewrites(self, replace(plan, tensor_parallel=tp, sequence_parallel=sp), tp_mesh=tp_mesh)
        applied.conversion = applied.conversion or report.conversion
        applied.steps[:0] = report.steps
        self.__dict__[_REPORT] = applied

    module.configure_model = types.MethodType(configure_model, module)


def planned_rewrite(module: Any) -> RewritePlan | None:
    """The plan :func:`rewrite_at_configure_model` installed on ``module`` (before or after it ran), ``None`` without
    one: a strategy asks it before ``configure_model`` builds the model (FSDP2 builds a model that gets adapters
    whole, not on the meta device)."""
    plan = getattr(module, "__dict__", {}).get(_PLAN)
    return plan if isinstance(plan, RewritePlan) else None


def _convert_by_plugin(module: Any) -> ConversionReport | None:
    """Step 1 through the strategy's precision plugin, when it converts (FP8, ``keep_fp32``) and not under ZeRO-3."""
    from lightning_trainopt.precision.transform_plugins import ModelTransforms

    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return None
    strategy = trainer.strategy
    plugin = strategy.precision_plugin
    if not isinstance(plugin, ModelTransforms) or getattr(strategy, "zero_stage_3", False):
        return None
    plugin.transform(module)
    return plugin.report


def _tp_mesh_of(module: Any) -> Any | None:
    """The tensor-parallel mesh of the module's strategy (``TrainOptTPStrategy.tp_mesh``), ``None`` without one."""
    trainer = getattr(module, "_trainer", None)
    mesh = getattr(getattr(trainer, "strategy", None), "tp_mesh", None)
    return mesh if mesh is not None and int(mesh.size()) > 1 else None


def _sequence_parallel_of(module: Any, default: bool) -> bool:
    """The module's strategy's ``sequence_parallel`` (``TrainOptTPStrategy``), ``default`` without one."""
    trainer = getattr(module, "_trainer", None)
    return bool(getattr(getattr(trainer, "strategy", None), "sequence_parallel", default))


def _tensor_parallel(
    model: nn.Module, degree: int, tp_mesh: Any, sequence_parallel: bool = True, compiled: bool = False
) -> TPReport:
    """Step 2: the model's tensor-parallel plan over ``tp_mesh``, with torchao's float8 plans where step 1 converted
    the linear layers to ``Float8Linear``."""
    if tp_mesh is None or int(tp_mesh.size()) != degree:
        raise ConfigError(
            "strategy.tensor_parallel_size",
            degree,
            "tensor parallelism needs its device mesh: use +strategy=tp or +strategy=fsdp_tp (or pass tp_mesh=...).",
        )
    float8 = any(type(m).__name__ == "Float8Linear" for m in model.modules())
    report = apply_tensor_parallel(
        model, tp_mesh, float8=float8, sequence_parallel=sequence_parallel, compiled=compiled
    )
    _tensor_parallel_teacher(model, tp_mesh, sequence_parallel)
    return report


def _tensor_parallel_teacher(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """A distillation teacher (``model.teacher``, models/distill.py) gets the student's plan on the same mesh: each
    rank holds ``1 / tp`` of it, its head is sharded over the vocabulary as the student's, and the distillation loss
    is vocabulary-parallel over both heads (transforms/distill_loss.py). Its blocks are not compiled (it only runs
    forward under no_grad)."""
    teacher = getattr(model, "teacher", None)
    if not isinstance(teacher, nn.Module):
        return
    check_teacher_tensor_parallel(teacher, int(tp_mesh.size()))
    float8 = any(type(m).__name__ == "Float8Linear" for m in teacher.modules())
    apply_tensor_parallel(teacher, tp_mesh, float8=float8, sequence_parallel=sequence_parallel)


def _fully_shard(model: nn.Module, plan: RewritePlan, mesh: Any) -> int:
    if mesh is None:
        raise ConfigError("strategy", "fsdp", "FSDP2 needs the data-parallel device mesh: pass mesh=...")
    units = list(plan.shard_modules) if plan.shard_modules is not None else block_classes(model)
    return apply_fully_shard(model, units, mesh, plan.cpu_offload, plan.reshard_after_forward)


def apply_fully_shard(
    root: torch.nn.Module, shard_modules: list[str], mesh: Any, cpu_offload: bool, reshard_after_forward: bool
) -> int:
    """``fully_shard`` every sub-module whose class name is in ``shard_modules``, then each top-level child.

    Works for any LightningModule: the LightningModule itself is not wrapped, only its parameter-holding children.
    Idempotent: a module that is already an FSDP2 unit is left as it is, because Lightning runs the strategy's
    ``setup`` again for every ``validate``/``test`` after ``fit`` on the same (sharded) model, and ``fully_shard``
    refuses a second application to one module.

    Returns:
        the number of modules sharded by this call (0 when the model was already sharded).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy(),
    }
    count = 0
    for module in root.modules():
        if module is not root and own_class(module).__name__ in shard_modules and not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
            count += 1
    for child in _top_level_units(root):
        if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)
            count += 1
    return count


def _top_level_units(root: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The children of ``root``, with a container (``nn.ModuleList``/``nn.ModuleDict``, which has no ``forward`` and
    which ``fully_shard`` refuses) replaced by its own children, recursively: a user's module that keeps its blocks in
    an ``nn.ModuleList`` directly, not inside a model module."""
    for child in root.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            yield from _top_level_units(child)
        else:
            yield child
