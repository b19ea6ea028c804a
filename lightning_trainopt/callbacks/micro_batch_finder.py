"""Largest micro-batch that fits a memory budget, with gradient accumulation keeping the global batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_trainopt.core.saved_tensors import SavedTensorsCounter
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.techniques.micro_batch import MicroBatchPlan, divisors, fit_linear_bytes, plan_micro_batch
from lightning_trainopt.techniques.optimizer_states import optimizer_state_bytes

__all__ = ["MicroBatchFinder"]

ForwardFn = Callable[[pl.LightningModule, Any], Any]
_KEY = "callbacks.micro_batch_finder"


def _default_forward(module: pl.LightningModule, batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return module(batch[0])
    if isinstance(batch, dict):
        return module(**batch)
    return module(batch)


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


def _tensor_bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = getattr(t, "ds_tensor", t)  # ZeRO-3 keeps only this rank's partition
        ptr = local.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += local.numel() * local.element_size()
    return total


def _base_optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer | None:
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    if engine is not None:
        return getattr(engine, "basic_optimizer", None)
    return trainer.optimizers[0] if trainer.optimizers else None


def _probe_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """State bytes of one step of a fresh optimizer of the same class on zero-gradient copies of the parameters."""
    groups = []
    for group in optimizer.param_groups:
        copies = []
        for p in group["params"]:
            c = torch.zeros(tuple(getattr(p, "ds_shape", p.shape)), dtype=p.dtype, device=p.device, requires_grad=True)
            c.grad = torch.zeros_like(c)
            copies.append(c)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": copies})
    probe = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in ("lr",)})
    probe.step()
    return optimizer_state_bytes(probe).state_bytes


class MicroBatchFinder(Callback):
    """Pick the largest micro-batch that fits, then set accumulation so the global batch stays as configured.

    Unlike Lightning's ``BatchSizeFinder`` (which changes the global batch), the global batch
    ``micro_batch x accumulate_grad_batches x world_size`` is kept; only divisors of the per-device batch are tried.
    At fit start the activation bytes saved for backward are measured at micro-batches 1 and 2 on a real batch
    (``SavedTensorsCounter``) and fitted as ``constant + per_sample x micro``; model states are measured too
    (parameters, gradients, and the optimizer's state from one probe step on zero copies, or ``model_state_bytes``).

    - On CPU the plan is checked against ``budget_bytes`` (required: the CPU has no allocator limit to probe).
    - On CUDA the budget defaults to ``budget_fraction`` of the device's total memory; the planned micro-batch is
      then confirmed by a forward/backward trial, stepping down on ``torch.OutOfMemoryError`` (not under DeepSpeed,
      whose gradient hooks must not see a trial backward; there the plan stands).
    - Under DeepSpeed the engine's ``train_micro_batch_size_per_gpu`` and accumulation are updated to match.

    Args:
        budget_bytes: memory budget per device in bytes.
        budget_fraction: on CUDA without ``budget_bytes``: this share of the device's memory.
        max_micro_batch: never go above this micro-batch.
        model_state_bytes: bytes of parameters + gradients + optimizer states per device, instead of measuring.
        batch_arg_name: the attribute holding the micro-batch (on the module, its hparams or the datamodule).
        forward_fn: ``(module, batch) -> output`` used to measure (default: ``module(batch[0])`` for tuples).

    Raises:
        ConfigError: bad arguments; no budget on CPU; nothing fits; no ``batch_arg_name`` attribute.

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
        self.forward_fn = forward_fn or _default_forward
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
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"{_KEY}.batch_arg_name",
                self.batch_arg_name,
                "no such attribute on the LightningModule, its hparams or the datamodule; name the one holding the "
                "micro-batch size.",
            )

    def _sample_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        datamodule = getattr(trainer, "datamodule", None)
        source = datamodule if datamodule is not None else pl_module
        batch = next(iter(source.train_dataloader()))
        return pl_module.transfer_batch_to_device(batch, pl_module.device, 0)

    def _activation_bytes(self, pl_module: pl.LightningModule, batch: Any, n: int) -> int:
        with SavedTensorsCounter(params=pl_module.parameters()) as counter:
            out = self.forward_fn(pl_module, _resize(batch, n))
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
            stage = int(getattr(trainer.strategy, "zero_stage", 0) or 0)
            world = max(1, trainer.world_size)
            # ZeRO shards optimizer states from stage 1 and gradients from stage 2 across the data-parallel ranks.
            state = state // world if stage >= 1 else state
            grad_bytes = grad_bytes // world if stage >= 2 else grad_bytes
        return param_bytes + grad_bytes + state

    def _trial(self, pl_module: pl.LightningModule, batch: Any, micro: int) -> bool:
        try:
            out = self.forward_fn(pl_module, _resize(batch, micro))
            loss = out.float().mean() if isinstance(out, torch.Tensor) else out["loss"]
            loss.backward()
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        finally:
            out = loss = None  # noqa: F841 - drop the graph before emptying the cache
            for p in pl_module.parameters():
                p.grad = None
            torch.cuda.empty_cache()
        self.trials.append({"micro_batch": micro, "fits": ok})
        return ok

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        micro0 = int(lightning_getattr(pl_module, self.batch_arg_name) or 0)
        accumulate0 = int(trainer.accumulate_grad_batches)
        world = max(1, trainer.world_size)
        global_batch = micro0 * accumulate0 * world
        batch = self._sample_batch(trainer, pl_module)
        per_sample, act_constant = fit_linear_bytes(
            self._activation_bytes(pl_module, batch, 1), self._activation_bytes(pl_module, batch, 2)
        )
        states = self._model_state_bytes(trainer, pl_module)
        on_cuda = pl_module.device.type == "cuda"
        budget = self.budget_bytes
        if budget is None:
            budget = int(torch.cuda.get_device_properties(pl_module.device).total_memory * self.budget_fraction)
        plan = plan_micro_batch(
            global_batch, world, per_sample, states + act_constant, budget, self.max_micro_batch, f"{_KEY}.budget_bytes"
        )
        if on_cuda and getattr(trainer.strategy, "deepspeed_engine", None) is None:
            options = [d for d in divisors(global_batch // world) if d <= plan.micro_batch]
            while options and not self._trial(pl_module, batch, options[-1]):
                options.pop()
            if not options:
                raise ConfigError(f"{_KEY}.budget_bytes", budget, "a micro-batch of 1 ran out of device memory.")
            if options[-1] != plan.micro_batch:
                plan = MicroBatchPlan(
                    **{
                        **plan.as_dict(),
                        "micro_batch": options[-1],
                        "accumulate": global_batch // world // options[-1],
                        "predicted_bytes": plan.fixed_bytes + options[-1] * per_sample,
                    }
                )
        self._apply(trainer, pl_module, plan)
        self.plan = plan
        rank_zero_info(
            f"MicroBatchFinder: micro-batch {micro0} -> {plan.micro_batch}, accumulation {accumulate0} -> "
            f"{plan.accumulate} (global batch {global_batch} kept); predicted {plan.predicted_bytes / 2**30:.3f} GiB "
            f"of {budget / 2**30:.3f} GiB ({per_sample / 2**20:.2f} MiB activations per sample)."
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
