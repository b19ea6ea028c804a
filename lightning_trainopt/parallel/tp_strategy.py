"""Tensor (and sequence) parallelism, with FSDP2 or HSDP over the data-parallel ranks: ``+strategy=tp|fsdp_tp``."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import set_device_mesh, set_model_parallel_sizes
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.apply import RewritePlan, apply_rewrites, rewrite_report
from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.fsdp import TrainOptFSDPStrategy, _without_configure_model_check
from lightning_trainopt.parallel.tp import clip_grad_norm_
from lightning_trainopt.precision.transform_plugins import ModelTransforms

__all__ = ["TrainOptTPStrategy"]


class TrainOptTPStrategy(TrainOptFSDPStrategy):
    """Tensor parallelism over ``tensor_parallel_size`` ranks (DTensor plans of :mod:`~lightning_trainopt.parallel.tp`),
    and FSDP2 over the data-parallel ranks that the world size leaves; ``replicate=R`` splits those into ``R``
    replicas of shards (HSDP).

    The device mesh is built from :class:`ParallelDims` (``tp`` innermost: a node's consecutive ranks form a
    tensor-parallel group): Lightning's own ``("data_parallel", "tensor_parallel")`` mesh without replicas, and a
    ``("dp_replicate", "dp_shard", "tp")`` mesh with them, which Lightning's strategy cannot build (Lightning #21059).
    The model is rewritten in the order of :mod:`~lightning_trainopt.parallel.apply`: conversions, tensor
    parallelism, activation techniques, compile, then ``fully_shard`` over the data-parallel mesh. Each training and
    validation step and its backward run under ``loss_parallel`` (the head's logits stay sharded over the
    vocabulary), and gradient clipping by norm works over DTensor and plain parameters alike.

    Args:
        tensor_parallel_size: ranks of one tensor-parallel group; ``"auto"``: every process of a node.
        replicate: data-parallel replicas (HSDP); 1: FSDP2 over all data-parallel ranks.
        shard_modules: FSDP2 units (class names); ``None``: the model's repeated block.
        cpu_offload: FSDP2's ``CPUOffloadPolicy``.
        reshard_after_forward: FSDP2 frees gathered parameters after forward.
        preset: name reported in metrics.
        sequence_parallel: split the norms and the residual stream over the sequence too (Megatron's sequence
            parallelism: activations divided by the TP size); ``False``: replicated, which FP8 needs on gloo (CPU),
            where no float8 tensor may cross a collective.
        meta_init: build the model on the meta device, split it (TP, then ``fully_shard``) and initialise, or read
            from ``model.pretrained``, only each rank's pieces (:mod:`~lightning_trainopt.parallel.meta_init`).
            ``False``: every rank builds the whole model, which is then split.
        **kwargs: :class:`lightning.pytorch.strategies.ModelParallelStrategy` arguments (sizes excepted).

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=TrainOptTPStrategy(tensor_parallel_size=2))  # 2 x 2
    """

    strategy_name = "trainopt_tp"

    def __init__(
        self,
        tensor_parallel_size: int | Literal["auto"] = "auto",
        replicate: int = 1,
        shard_modules: list[str] | tuple[str, ...] | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        preset: str = "tp",
        meta_init: bool = True,
        sequence_parallel: bool = True,
        **kwargs: Any,
    ) -> None:
        if tensor_parallel_size != "auto" and (
            isinstance(tensor_parallel_size, bool)
            or not isinstance(tensor_parallel_size, int)
            or tensor_parallel_size < 1
        ):
            raise ConfigError(
                "strategy.tensor_parallel_size", tensor_parallel_size, "use a positive whole number, or auto."
            )
        if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
            raise ConfigError("strategy.replicate", replicate, "use a positive whole number (1: no replicas).")
        for key in ("data_parallel_size",):
            if key in kwargs:
                raise ConfigError(
                    f"strategy.{key}",
                    kwargs[key],
                    "the tensor-parallel strategy sets it itself: remove it (the data-parallel size is what the "
                    "world size leaves after tensor_parallel_size; replicate=R makes R replicas of it).",
                )
        super().__init__(
            shard_modules,
            cpu_offload,
            reshard_after_forward,
            preset,
            meta_init=meta_init,
            data_parallel_size=1,
            **kwargs,
        )
        self.tensor_parallel_size = tensor_parallel_size
        if not isinstance(sequence_parallel, bool):
            raise ConfigError("strategy.sequence_parallel", sequence_parallel, "use true or false.")
        self.replicate = replicate
        self.sequence_parallel = sequence_parallel
        self.parallel_dims: ParallelDims | None = None

    @override
    def setup_environment(self) -> None:
        tp = self.num_processes if self.tensor_parallel_size == "auto" else self.tensor_parallel_size
        dims = ParallelDims.from_config(self.num_processes, self.num_nodes, tp=tp, dp_replicate=self.replicate)
        self.parallel_dims = dims
        set_model_parallel_sizes(self, dims.dp, dims.tp)
        ModelParallelStrategy.setup_environment(self)  # Lightning's 2-D mesh: (data_parallel, tensor_parallel)
        if dims.dp_replicate > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                self.root_device.type,
                (dims.dp_replicate, dims.dp_shard, dims.tp),
                mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
            )
            set_device_mesh(self, mesh)

    @property
    def tp_mesh(self) -> Any:
        """The tensor-parallel dimension of the device mesh (what :func:`apply_tensor_parallel` splits over)."""
        mesh = self.device_mesh
        return mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else mesh["tensor_parallel"]

    @property
    def dp_mesh(self) -> Any:
        """The data-parallel dimensions (FSDP2's mesh: 1-D, or 2-D replicas x shards for HSDP)."""
        mesh = self.device_mesh
        if "dp_replicate" in (mesh.mesh_dim_names or ()):
            return mesh["dp_replicate", "dp_shard"]
        return mesh["data_parallel"]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one tensor-parallel group read the same samples (ParallelDims is the one source of this).
        assert self.parallel_dims is not None
        return self.parallel_dims.sampler_kwargs(self.global_rank)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.parallel_dims is not None
        dims = self.parallel_dims
        from torch.distributed.tensor import DTensor

        report = rewrite_report(self.model)
        # Lightning sets the strategy up again for each validate/test after fit, on the model already split.
        done = any(isinstance(p, DTensor) for p in self.model.parameters())
        if not done and (report is None or "tensor_parallel" not in report.steps):
            # No rewrite ran at configure_model (no activation technique, no compile): steps 1-2 here.
            if isinstance(self.precision_plugin, ModelTransforms):
                self.precision_plugin.transform(self.model)
            plan = RewritePlan(tensor_parallel=dims.tp, sequence_parallel=self.sequence_parallel)
            apply_rewrites(self.model, plan, tp_mesh=self.tp_mesh)
        if dims.dp > 1:
            plan = RewritePlan(
                shard="fsdp2",
                shard_modules=tuple(self._units(self.model)),
                cpu_offload=self.cpu_offload,
                reshard_after_forward=self.reshard_after_forward,
            )
            apply_rewrites(self.model, plan, self.dp_mesh)
        # A meta build gets storage and values for this rank's pieces only, now that TP and FSDP2 have placed them.
        self._materialize(self.model)
        how = f"HSDP {dims.dp_replicate} x {dims.dp_shard}" if dims.dp_replicate > 1 else f"FSDP2 over {dims.dp}"
        rank_zero_info(f"Tensor parallel: {dims.tp} ranks per group; {how} data-parallel ranks.")
        module = self.lightning_module
        with contextlib.nullcontext() if module is None else _without_configure_model_check(module):
            ModelParallelStrategy.setup(self, trainer)
        self._clip_mixed_parameters()
        if module is not None:
            _plain_batch_loss(module)

    def _clip_mixed_parameters(self) -> None:
        """Clip by norm through :func:`~lightning_trainopt.parallel.tp.clip_grad_norm_`: torch's own fails on a mix
        of DTensors and plain tensors (torchtune #2420). Set on the precision plugin's instance, whose public
        ``clip_grad_by_norm`` every clipping path of Lightning calls."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(self: Any, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
            clip_grad_norm_(self.main_params(optimizer), float(clip_val))

        plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)  # type: ignore[method-assign]

    @contextlib.contextmanager
    def _loss_parallel(self) -> Iterator[None]:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_parallel():
            return _local(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_parallel():
            return _local(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_parallel():
            return _local(super().test_step(*args, **kwargs))

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._loss_parallel():
            return super().backward(closure_loss, optimizer, *args, **kwargs)


def _plain_batch_loss(module: Any) -> None:
    """Make our LightningModules' ``batch_loss`` return a plain tensor (on the instance, once): their steps log it and
    add it to a ``MeanMetric``, which cannot mix a DTensor with its plain state; the gradient flows through
    ``to_local``. A user's module keeps its own (its step's returned loss is made plain by :func:`_local`)."""
    own = getattr(module, "batch_loss", None)
    if own is None or "batch_loss" in module.__dict__:
        return

    def batch_loss(batch: Any) -> Any:
        loss, tokens = own(batch)
        return _local(loss), tokens

    module.__dict__["batch_loss"] = batch_loss


def _local(output: Any) -> Any:
    """A step's loss as a plain tensor (the loss-parallel cross-entropy returns a replicated DTensor), so Lightning's
    loop and loggers see what they see under every other strategy; the gradient still flows through ``to_local``."""
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, dict) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": output["loss"].to_local()}
    return output
