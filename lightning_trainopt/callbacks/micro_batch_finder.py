"""Largest micro-batch that fits a memory budget, with gradient accumulation keeping the global batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.memory_accounting import tensor_leaves
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter
from lightning_trainopt.optim.micro_batch import MicroBatchPlan, divisors, fit_linear_bytes, plan_micro_batch
from lightning_trainopt.parallel.dims import ParallelDims
from lightning_trainopt.parallel.spec import spec_of

__all__ = ["MicroBatchFinder"]

ForwardFn = Callable[[pl.LightningModule, Any], Any]
_KEY = "callbacks.micro_batch_finder"


def _default_step(module: pl.LightningModule, batch: Any) -> Any:
    """The module's own ``training_step``: forward *and* loss (a large vocabulary's saved log-softmax is often the
    biggest activation), exactly as the fit loop runs it."""
    return module.training_step(batch, 0)


@contextmanager
def _measuring(trainer: pl.Trainer, module: pl.LightningModule) -> Iterator[None]:
    """Run a measured step as the fit loop would: inside the precision plugin's context (autocast for ``*-mixed``,
    the default dtype for ``*-true``), with ``self.log`` silenced (the fit loop's results must not see trial steps,
    and ``log(sync_dist=True)`` would start a collective some ranks might not join)."""
    module.__dict__["log"] = _no_log
    module.__dict__["log_dict"] = _no_log
    try:
        with trainer.precision_plugin.train_step_context():
            yield
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out if out.numel() == 1 else out.float().mean()
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    raise ConfigError(
        f"{_KEY}.forward_fn",
        None,
        f"the measured step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'; give a "
        "forward_fn(module, batch) that returns the loss.",
    )


def _min_across_ranks(trainer: pl.Trainer, value: int, device: torch.device) -> int:
    """The smallest ``value`` over all ranks (every rank must train the same micro-batch and accumulation)."""
    if trainer.world_size <= 1:
        return value
    gathered = trainer.strategy.all_gather(torch.tensor([value], dtype=torch.int64, device=device))
    return int(gathered.min().item())


def _resize(batch: Any, n: int) -> Any:
    """The batch with ``n`` samples along dim 0 (repeating samples when it has fewer)."""
    if isinstance(batch, torch.Tensor):
        reps = -(-n // batch.shape[0])
        return (torch.cat([batch] * reps) if reps > 1 else batch)[:n]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_resize(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _resize(v, n) for k, v in batch.items()}
    return batch


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: ZeRO-3's partition, FSDP2's / tensor parallelism's local shard."""
    t = getattr(t, "ds_tensor", t)
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensor_bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        for leaf in tensor_leaves(_local(t)):
            ptr = leaf.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            total += leaf.numel() * leaf.element_size()
    return total


def _base_optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer | None:
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    if engine is not None:
        return getattr(engine, "basic_optimizer", None)
    return trainer.optimizers[0] if trainer.optimizers else None


def _probe_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """State bytes ``optimizer`` will hold after its first step, measured without touching the accelerator.

    A fresh optimizer of the same class takes one step on the CPU over one zero copy per distinct (group, shape,
    dtype) of the parameters (ZeRO-3's full ``ds_shape``, an FSDP2 shard's local shape); each copy's state bytes
    count once for every parameter it stands for. A transformer's blocks repeat, so the probe holds about one block
    (plus embeddings), never the whole model's states on the device this callback is meant to keep from running out
    of memory.
    """
    groups = []
    weights: dict[int, int] = {}
    for group in optimizer.param_groups:
        copies: dict[tuple[Any, ...], torch.Tensor] = {}
        for p in group["params"]:
            shape = getattr(p, "ds_shape", None) or _local(p).shape  # FSDP2 shards: the local shard's shape
            key = (tuple(shape), p.dtype)
            if key not in copies:
                c = torch.zeros(key[0], dtype=p.dtype, device="cpu", requires_grad=True)
                c.grad = torch.zeros_like(c)
                copies[key] = c
            weights[id(copies[key])] = weights.get(id(copies[key]), 0) + 1
        options = {k: v for k, v in group.items() if k not in ("params", "fused", "foreach", "capturable")}
        groups.append({**options, "params": list(copies.values())})
    probe = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in ("lr",)})
    probe.step()
    total = 0
    for group in probe.param_groups:
        for c in group["params"]:
            seen: set[int] = set()
            own = 0
            for value in probe.state.get(c, {}).values():
                if not isinstance(value, torch.Tensor):
                    continue
                for leaf in tensor_leaves(value):
                    storage = leaf.untyped_storage()
                    if storage.data_ptr() in seen:
                        continue
                    seen.add(storage.data_ptr())
                    own += storage.nbytes()
            total += own * weights[id(c)]
    return total


class MicroBatchFinder(Callback):
    """Pick the largest micro-batch that fits, then set accumulation so the global batch stays as configured.

    Unlike Lightning's ``BatchSizeFinder`` (which changes the global batch), the global batch
    ``micro_batch x accumulate_grad_batches x data-parallel size`` is kept (the data-parallel size is
    :class:`~lightning_trainopt.parallel.dims.ParallelDims`' ``dp``: the world size without tensor parallelism); only
    divisors of the per-replica batch are tried.
    At fit start the activation bytes saved for backward are measured at micro-batches 1 and 2 on a real batch
    (``SavedTensorsCounter``) and fitted as ``constant + per_sample x micro``. What is measured is the module's own
    ``training_step`` (forward *and* loss), inside the precision plugin's context (autocast under ``bf16-mixed``),
    as the fit loop runs it; ``self.log`` is silenced meanwhile. Model states are measured too (parameters,
    gradients, and the optimizer's state from one probe step on the CPU over one zero copy per distinct parameter
    shape, or ``model_state_bytes``). The model is measured with activation checkpointing applied: an
    :class:`ActivationCheckpointing` of the same Trainer is applied first, wherever it is in the callback list.
    Saved-tensor transforms (int8 compression) are not active during the
    measurement, so with them the plan errs on the safe side.

    - On CPU the plan is checked against ``budget_bytes`` (required: the CPU has no allocator limit to probe).
    - On CUDA the budget defaults to ``budget_fraction`` of the device's total memory; the planned micro-batch is
      then confirmed by a forward/backward trial, stepping down on ``torch.OutOfMemoryError`` (not under DeepSpeed,
      whose gradient hooks must not see a trial backward; there the plan stands).
    - Under DeepSpeed the engine's ``train_micro_batch_size_per_gpu`` and accumulation are updated to match.
    - With several ranks every rank takes the smallest micro-batch any rank chose (and trials step down together),
      so all ranks run the same number of micro-batches per optimizer step.
    - When the global batch has no divisor near the largest micro-batch that fits (a prime global batch falls
      back to 1), it warns and names nearby global batches that divide better.

    Args:
        budget_bytes: memory budget per device in bytes.
        budget_fraction: on CUDA without ``budget_bytes``: this share of the device's memory.
        max_micro_batch: never go above this micro-batch.
        model_state_bytes: bytes of parameters + gradients + optimizer states per device, instead of measuring.
        batch_arg_name: the attribute holding the micro-batch, looked up and set as Lightning's ``BatchSizeFinder``
            does (``lightning_hasattr`` / ``lightning_setattr``: the module, its hparams, the datamodule, its
            hparams); the ``train_dataloader()`` must read its batch size from it.
        forward_fn: ``(module, batch) -> loss`` used to measure, run inside the precision context (default: the
            module's ``training_step(batch, 0)``). Required under manual optimisation, whose ``training_step``
            steps the optimizers itself.

    Raises:
        ConfigError: bad arguments; no budget on CPU; nothing fits; no ``batch_arg_name`` attribute, or a training
            ``DataLoader`` whose batch size does not follow it; manual optimisation without ``forward_fn``.

    Example::

        trainer = Trainer(accelerator="cpu", callbacks=[MicroBatchFinder(budget_bytes=2 * 2**30)])
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        budget_fraction: float = 0.9,
        max_micro_batch: int | None = None,
        model_state_bytes: int | None = None,
        batch_arg_name: str = "batch_size",
        forward_fn: ForwardFn | None = None,
    ) -> None:
        if budget_bytes is not None and (not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0):
            raise ConfigError(f"{_KEY}.budget_bytes", budget_bytes, "use a positive number of bytes, e.g. 8e9.")
        if not 0.0 < budget_fraction <= 1.0:
            raise ConfigError(f"{_KEY}.budget_fraction", budget_fraction, "use a share in (0, 1], e.g. 0.9.")
        if max_micro_batch is not None and (not isinstance(max_micro_batch, int) or max_micro_batch < 1):
            raise ConfigError(f"{_KEY}.max_micro_batch", max_micro_batch, "use a positive integer or null.")
        if model_state_bytes is not None and model_state_bytes < 0:
            raise ConfigError(f"{_KEY}.model_state_bytes", model_state_bytes, "use a non-negative byte count or null.")
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.budget_fraction = budget_fraction
        self.max_micro_batch = max_micro_batch
        self.model_state_bytes = model_state_bytes
        self.batch_arg_name = batch_arg_name
        self.forward_fn = forward_fn
        self.plan: MicroBatchPlan | None = None
        self.trials: list[dict[str, Any]] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.budget_bytes is None and trainer.accelerator.__class__.__name__ != "CUDAAccelerator":
            raise ConfigError(
                f"{_KEY}.budget_bytes",
                None,
                "on CPU there is no allocator limit to probe: give the memory budget per process in bytes, "
                f"e.g. {_KEY}.budget_bytes=4e9.",
            )
        if self.forward_fn is None and not pl_module.automatic_optimization:
            raise ConfigError(
                f"{_KEY}.forward_fn",
                None,
                "the module uses manual optimisation, so its training_step steps the optimizers and cannot be run "
                "as a measurement; give forward_fn(module, batch) returning the loss.",
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"{_KEY}.batch_arg_name",
                self.batch_arg_name,
                "no such attribute on the LightningModule, its hparams, the datamodule or its hparams (where "
                "Lightning's BatchSizeFinder looks too). Name the attribute your train_dataloader() reads as its "
                "batch size; if it passes a literal (DataLoader(..., batch_size=16)), store it first, e.g. "
                "self.batch_size = 16 in __init__ and DataLoader(..., batch_size=self.batch_size), or "
                "self.save_hyperparameters() and self.hparams.batch_size.",
            )

    def _sample_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        datamodule = getattr(trainer, "datamodule", None)
        source = datamodule if datamodule is not None else pl_module
        batch = next(iter(source.train_dataloader()))
        return pl_module.transfer_batch_to_device(batch, pl_module.device, 0)

    def _step(self, pl_module: pl.LightningModule, batch: Any) -> Any:
        step = self.forward_fn or _default_step
        return step(pl_module, batch)

    def _activation_bytes(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, n: int) -> int:
        with _measuring(trainer, pl_module), SavedTensorsCounter(params=pl_module.parameters()) as counter:
            out = self._step(pl_module, _resize(batch, n))
        del out
        return counter.report().activation_bytes

    def _model_state_bytes(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        if self.model_state_bytes is not None:
            return int(self.model_state_bytes)
        params = list(pl_module.parameters())
        param_bytes = _tensor_bytes(params)
        grad_bytes = _tensor_bytes(p for p in params if p.requires_grad)
        optimizer = _base_optimizer(trainer)
        state = 0
        if optimizer is not None:
            try:
                state = _probe_state_bytes(optimizer)
            except (TypeError, RuntimeError, ValueError) as err:
                raise ConfigError(
                    f"{_KEY}.model_state_bytes",
                    None,
                    f"could not measure the state of {type(optimizer).__name__} by a probe step ({err}); give "
                    "parameters + gradients + optimizer-state bytes per device explicitly.",
                ) from err
            zero = spec_of(trainer.strategy)
            world = ParallelDims.from_trainer(trainer).dp  # ZeRO partitions over the data-parallel ranks
            module_params = {id(p) for p in params}
            own = [p for g in optimizer.param_groups for p in g["params"]]
            if own and not any(id(p) in module_params for p in own):
                # DeepSpeed ZeRO-1/2 hands the wrapped optimizer this rank's flat fp32 master partitions: the probe
                # already measured a per-rank share, and the masters themselves are optimizer state.
                state += _tensor_bytes(own)
            elif zero.flat_partitions:
                state //= world
            # ZeRO shards gradients from stage 2 across the data-parallel ranks. Under ZeRO-3 the bytes were read from
            # the parameters' own partitions (``ds_tensor``), already one rank's share: divide only what is whole.
            partitioned = any(hasattr(p, "ds_tensor") for p in params)
            grad_bytes = (
                grad_bytes // world if zero.flat_partitions and zero.shards_grads and not partitioned else grad_bytes
            )
        return param_bytes + grad_bytes + state

    def _trial(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, micro: int) -> bool:
        ok = False
        loss: torch.Tensor | None = None
        try:
            with _measuring(trainer, pl_module):
                loss = _loss_of(self._step(pl_module, _resize(batch, micro)))
            loss.backward()
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        finally:
            loss = None  # drop the graph before emptying the cache
            for p in pl_module.parameters():
                p.grad = None
            torch.cuda.empty_cache()
        # Every rank must step down together, or the ranks' collectives (FSDP2, DDP) would pair up wrongly.
        ok = bool(_min_across_ranks(trainer, int(ok), pl_module.device))
        self.trials.append({"micro_batch": micro, "fits": ok})
        return ok

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing

        # Measure the model as it will train: an ActivationCheckpointing listed after this callback would wrap the
        # blocks only after the measurement (a micro-batch several times too small); apply it now (idempotent).
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, ActivationCheckpointing):
                cb.on_fit_start(trainer, pl_module)
        micro0 = int(lightning_getattr(pl_module, self.batch_arg_name) or 0)
        accumulate0 = int(trainer.accumulate_grad_batches)
        # Replicas, not ranks: the ranks of a tensor-parallel group train the same micro-batches.
        world = ParallelDims.from_trainer(trainer).dp
        global_batch = micro0 * accumulate0 * world
        batch = self._sample_batch(trainer, pl_module)
        per_sample, act_constant = fit_linear_bytes(
            self._activation_bytes(trainer, pl_module, batch, 1), self._activation_bytes(trainer, pl_module, batch, 2)
        )
        states = self._model_state_bytes(trainer, pl_module)
        on_cuda = pl_module.device.type == "cuda"
        budget = self.budget_bytes
        if budget is None:
            budget = int(torch.cuda.get_device_properties(pl_module.device).total_memory * self.budget_fraction)
        plan = plan_micro_batch(
            global_batch, world, per_sample, states + act_constant, budget, self.max_micro_batch, f"{_KEY}.budget_bytes"
        )
        micro = _min_across_ranks(trainer, plan.micro_batch, pl_module.device)
        if on_cuda and getattr(trainer.strategy, "deepspeed_engine", None) is None:
            options = [d for d in divisors(global_batch // world) if d <= micro]
            while options and not self._trial(trainer, pl_module, batch, options[-1]):
                options.pop()
            if not options:
                raise ConfigError(f"{_KEY}.budget_bytes", budget, "a micro-batch of 1 ran out of device memory.")
            micro = options[-1]
        if micro != plan.micro_batch:
            plan = replace(
                plan,
                micro_batch=micro,
                accumulate=global_batch // world // micro,
                predicted_bytes=plan.fixed_bytes + micro * per_sample,
            )
        self._apply(trainer, pl_module, plan)
        self.plan = plan
        advice = plan.divisor_advice()
        if advice:
            rank_zero_warn(f"MicroBatchFinder: {advice}", category=UserWarning)
        rank_zero_info(
            f"MicroBatchFinder: micro-batch {micro0} -> {plan.micro_batch}, accumulation {accumulate0} -> "
            f"{plan.accumulate} (global batch {global_batch} kept); predicted {plan.predicted_bytes / 2**30:.3f} GiB "
            f"of {budget / 2**30:.3f} GiB ({per_sample / 2**20:.2f} MiB activations per sample)."
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The fit loop builds the DataLoader after on_fit_start: one whose batch size does not come from
        # batch_arg_name would train micro_batch0 x the raised accumulation, a larger global batch than configured.
        loader = trainer.train_dataloader
        size = getattr(loader, "batch_size", None)
        if self.plan is None or not isinstance(loader, torch.utils.data.DataLoader) or size is None:
            return
        if size != self.plan.micro_batch:
            raise ConfigError(
                f"{_KEY}.batch_arg_name",
                self.batch_arg_name,
                f"it was set to the chosen micro-batch {self.plan.micro_batch}, but the training DataLoader was built "
                f"with batch_size={size}: make train_dataloader() read its batch size from that attribute.",
            )

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: MicroBatchPlan) -> None:
        lightning_setattr(pl_module, self.batch_arg_name, plan.micro_batch)
        trainer.accumulate_grad_batches = plan.accumulate
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if engine is not None:
            # DeepSpeed scales the loss and steps at its own accumulation boundary: keep its config in step.
            engine.set_train_micro_batch_size(plan.micro_batch)
            engine.set_train_batch_size(plan.global_batch)
            config = getattr(trainer.strategy, "config", None)
            if isinstance(config, dict):
                config["train_micro_batch_size_per_gpu"] = plan.micro_batch
                config["gradient_accumulation_steps"] = plan.accumulate

    def summary(self) -> dict[str, Any]:
        """``{"micro_batch_finder": {micro_batch, accumulate, global_batch, per_sample_bytes, ...}}``."""
        if self.plan is None:
            return {}
        return {"micro_batch_finder": {**self.plan.as_dict(), "trials": list(self.trials)}}
