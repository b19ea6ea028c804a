"""FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy, sharded by a policy over module classes."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import PathLike, shard_fully_when_auto
from lightning_trainopt.checkpoint.files import save_directory_checkpoint
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.adapters import prepare_4bit_for_fsdp2
from lightning_trainopt.parallel.apply import RewritePlan, apply_fully_shard, apply_rewrites, planned_rewrite
from lightning_trainopt.parallel.ddp import DimsSampling
from lightning_trainopt.parallel.meta_init import has_meta_tensors, materialize_sharded
from lightning_trainopt.parallel.spec import StrategySpec, fsdp_spec
from lightning_trainopt.precision.transform_plugins import ModelTransforms
from lightning_trainopt.transforms.blocks import block_classes, own_class

__all__ = ["TrainOptFSDPStrategy", "apply_fully_shard", "block_classes"]


def _adapter_planned(module: pl.LightningModule) -> bool:
    """The app's rewrite installed on ``module`` injects LoRA/QLoRA adapters."""
    adapter = getattr(planned_rewrite(module), "adapter", None)
    return adapter is not None and getattr(adapter, "kind", "none") != "none"


@contextlib.contextmanager
def _without_configure_model_check(module: pl.LightningModule) -> Iterator[None]:
    """Lightning's ``ModelParallelStrategy.setup`` refuses a LightningModule without ``configure_model``, where it
    expects the user to apply the parallelism; this strategy applies it itself, so any module will do. A no-op
    ``configure_model`` on the instance satisfies that check for the duration of ``setup`` (``configure_model`` has
    run by then) and is removed after."""
    if is_overridden("configure_model", module):
        yield
        return
    module.__dict__["configure_model"] = lambda: None
    try:
        yield
    finally:
        module.__dict__.pop("configure_model", None)


class TrainOptFSDPStrategy(DimsSampling, ModelParallelStrategy):
    """FSDP2 full sharding over all processes (no tensor parallelism), usable with any LightningModule.

    After ``configure_model`` builds the model (a LightningModule without one works too: its model is built in
    ``__init__``), every module whose class name is in ``shard_modules`` becomes its own FSDP2 unit, then each
    parameter-holding child of the LightningModule. Runs on CPU (gloo) and GPU.

    Args:
        shard_modules: class names to shard as units (the transformer block). Default (``None``): the model's
            repeated block, found by :func:`block_classes` (a Hugging Face model's ``_no_split_modules``, else the
            class of its largest ``nn.ModuleList`` of same-class modules); a model with neither is sharded by its
            top-level children only, and one line says so.
        cpu_offload: keep parameters, gradients and optimizer states on the CPU (``CPUOffloadPolicy``).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3-like) or keep them (ZeRO-2-like).
        preset: name reported in metrics.
        meta_init: build the model on the meta device (:meth:`builds_on_meta`) and initialise each rank's shards
            after ``fully_shard``, or read them from ``model.pretrained`` (a rank never holds the whole model).
            ``False``: build the whole model in host memory on every rank first.
        **kwargs: :class:`lightning.pytorch.strategies.ModelParallelStrategy` arguments.

    Example::

        Trainer(accelerator="cpu", devices=2, strategy=TrainOptFSDPStrategy(shard_modules=["Block"]))
    """

    strategy_name = "trainopt_fsdp"

    def __init__(
        self,
        shard_modules: list[str] | tuple[str, ...] | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        preset: str = "fsdp",
        meta_init: bool = True,
        **kwargs: Any,
    ) -> None:
        if shard_modules is not None and (
            isinstance(shard_modules, str) or not all(isinstance(s, str) and s for s in shard_modules)
        ):
            raise ConfigError(
                "strategy.shard_modules",
                shard_modules,
                "give a list of class names, e.g. [Block], or null for the model's repeated block.",
            )
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)
        self.shard_modules = None if shard_modules is None else list(shard_modules)
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward
        self.preset = preset
        self.meta_init = meta_init
        self._meta_rng_state: torch.Tensor | None = None
        target = f"{type(self).__module__}.{type(self).__qualname__}"
        self.spec: StrategySpec = fsdp_spec(preset, target, cpu_offload, reshard_after_forward)

    def offload_devices(self) -> dict[str, str]:
        """``{"optimizer": ..., "param": ...}``: ``cpu`` for both with ``cpu_offload``."""
        return self.spec.offload

    @override
    def setup_environment(self) -> None:
        shard_fully_when_auto(self)  # full sharding: every process is a data-parallel rank
        super().setup_environment()

    def _units(self, model: torch.nn.Module) -> list[str]:
        """The class names to shard: ``shard_modules``, each present in the model, or the model's repeated block."""
        if self.shard_modules is None:
            return block_classes(model)
        present = {own_class(m).__name__ for m in model.modules()}
        missing = [name for name in self.shard_modules if name not in present]
        if missing:
            found = block_classes(model)
            hint = f"its repeated block is {found}, which " if found else ""
            raise ConfigError(
                "strategy.shard_modules",
                self.shard_modules,
                f"{missing} matched no module of {type(model).__name__}; use class names of its modules ({hint}"
                "shard_modules=null picks by itself).",
            )
        return self.shard_modules

    def builds_on_meta(self, module: pl.LightningModule | None) -> bool:
        """``configure_model`` of ``module`` runs on the meta device: our GPT presets, a Hugging Face model (from its
        config, or ``model.pretrained``, then read slice by slice) and a user's module whose ``configure_model`` builds
        its layers (it has no parameter before); their init is replayed per shard after ``fully_shard``
        (:mod:`~lightning_trainopt.parallel.meta_init`). A user's module that builds its model in ``__init__`` is
        built whole, as before."""
        from lightning_trainopt.models import LitCausalLM, LitGPT

        if not self.meta_init or module is None:
            return False
        if _adapter_planned(module):
            # peft injects into built layers (QLoRA quantizes real weights) and the meta replay would draw the
            # adapters' init as the base's: a model with adapters is built whole, then sharded.
            return False
        if isinstance(module, (LitGPT, LitCausalLM)):
            return module.model is None
        return is_overridden("configure_model", module) and next(module.parameters(), None) is None

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if empty_init is False or not self.builds_on_meta(self.lightning_module):
            with super().tensor_init_context(empty_init):
                yield
            return
        # The replay after fully_shard draws from the generator state the eager build would have started from.
        self._meta_rng_state = torch.get_rng_state()
        with super().tensor_init_context(empty_init=True):
            yield

    def _materialize(self, model: torch.nn.Module) -> None:
        """Storage and initial values for this rank's shards of a model built on the meta device."""
        if not has_meta_tensors(model):
            return
        from lightning_trainopt.models import LitCausalLM

        device = torch.device("cpu") if self.cpu_offload else self.root_device
        module = self.lightning_module
        pretrained = module.pretrained_files() if isinstance(module, LitCausalLM) else None
        n = materialize_sharded(model, device, self._meta_rng_state, pretrained)
        self._meta_rng_state = None
        how = "read from model.pretrained" if pretrained else "initialised"
        rank_zero_info(f"FSDP2: built on the meta device; {n} parameters {how} shard by shard on {device}.")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        from torch.distributed.fsdp import FSDPModule

        already = any(isinstance(m, FSDPModule) for m in self.model.modules())
        if not already and isinstance(self.precision_plugin, ModelTransforms):
            # FP8 layers must exist before fully_shard: torchao's FP8 weight subclass is what FSDP2 all-gathers in
            # FP8 (torchtitan's order). Lightning's own call in super().setup() then finds the model converted.
            self.precision_plugin.transform(self.model)
        units = self._units(self.model)
        if not already:
            prepare_4bit_for_fsdp2(self.model)  # QLoRA: float storage, no in-place CPU repacking (parallel/adapters)
        # The ordered rewrite's last step (its layer conversion ran just above, through the precision plugin, which
        # keeps the report PrecisionReport reads).
        plan = RewritePlan(
            shard="fsdp2",
            shard_modules=tuple(units),
            cpu_offload=self.cpu_offload,
            reshard_after_forward=self.reshard_after_forward,
        )
        n = apply_rewrites(self.model, plan, self.device_mesh["data_parallel"]).sharded
        if n == 0 and not already:
            raise ConfigError(
                "strategy.shard_modules",
                self.shard_modules,
                f"{type(self.model).__name__} has no parameter to shard; FSDP needs a model with parameters.",
            )
        if n:
            by = f"{units} blocks" if units else "no repeated block found: top-level children only"
            rank_zero_info(
                f"FSDP2: {n} modules sharded over {self.world_size} processes ({by}; cpu_offload={self.cpu_offload})."
            )
        self._materialize(self.model)
        module = self.lightning_module
        with contextlib.nullcontext() if module is None else _without_configure_model_check(module):
            super().setup(trainer)

    @override
    def model_to_device(self) -> None:
        if self.cpu_offload:
            return  # CPUOffloadPolicy keeps sharded parameters on the CPU and moves them per unit.
        super().model_to_device()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None
    ) -> None:
        """Write the (sharded) checkpoint to a staging directory; swap it in once every rank wrote its part."""
        parent_save = super().save_checkpoint
        save_directory_checkpoint(self, filepath, lambda staging: parent_save(checkpoint, staging, storage_options))

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the DCP checkpoint into the module without the submodules it leaves out of its checkpoints (a
        distillation teacher, read from its own source): DCP would ask the checkpoint for their tensors."""
        excluded = getattr(self.lightning_module, "excluded_from_checkpoint", None)
        with excluded() if callable(excluded) else contextlib.nullcontext():
            return super().load_checkpoint(checkpoint_path, weights_only)
