"""MemoryBreakdown: bytes per rank of parameters, gradients, optimizer states, activations and other."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_trainopt.callbacks._common import json_safe, log_metrics
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.adapter_accounting import adapter_breakdown, has_frozen_params
from lightning_trainopt.metrics.memory_accounting import memory_breakdown
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter
from lightning_trainopt.parallel.report import strategy_offload

__all__ = ["MemoryBreakdown", "accounted_model_states"]

ModelStateFn = Callable[[pl.Trainer, pl.LightningModule], dict[str, int]]


def accounted_model_states(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int]:
    """Per-rank model-state bytes from :func:`lightning_trainopt.metrics.memory_accounting.memory_breakdown`.

    ``params``/``grads``/``optimizer_states`` are the bytes on the compute device; offloaded bytes appear as
    ``<name>_cpu`` and ``<name>_nvme`` when non-zero. ZeRO/FSDP shards count by their local size.
    """
    offload = strategy_offload(trainer.strategy)
    mb = memory_breakdown(pl_module, trainer.optimizers, trainer.strategy.root_device, offload=offload)
    out: dict[str, int] = {}
    for name, placed in mb.to_dict().items():
        out[name] = int(placed["device"])
        for where in ("cpu", "nvme"):
            if placed[where]:
                out[f"{name}_{where}"] = int(placed[where])
    return out


def _metric_names(row: dict[str, Any]) -> dict[str, float]:
    """The logged ``memory/<key>_bytes`` metrics of a breakdown row (``peak_memory_bytes`` keeps its one suffix)."""
    return {
        f"memory/{k if k.endswith('_bytes') else k + '_bytes'}": float(v)
        for k, v in row.items()
        if isinstance(v, int) and not isinstance(v, bool)
    }


class MemoryBreakdown(Callback):
    """The four-part memory table (model states, activations, other) per rank at chosen optimizer steps.

    Activations are the bytes saved for backward, counted through
    :class:`~lightning_trainopt.metrics.saved_tensors.SavedTensorsCounter` during the forward passes of the measured
    step (the largest micro-batch under accumulation). On CUDA, ``peak`` is the allocator's peak over that step and
    ``other`` = peak - (params + grads + optimizer states + activations): temporaries, workspace, fragmentation.
    On CPU there are no allocator statistics, so ``other`` and ``peak_memory_bytes`` are ``None``.
    ``activations_weight_copies`` is the part of ``activations`` that autocast's half-precision copies of weights take
    (saved for the input gradient; it does not shrink with the micro-batch, but checkpointing and int8 compression cut
    it like any saved tensor). Copies of frozen weights (a LoRA/PEFT model's base under ``bf16-mixed``) are in it:
    the counter is given the module's parameters and matches a cast without autograd history by shape and value.
    A step whose ``training_step`` returns ``None`` (no backward) is not measured; the next one is.

    A model with frozen parameters (a LoRA/QLoRA base, a distillation teacher) gets the rows of
    :func:`~lightning_trainopt.metrics.adapter_accounting.adapter_breakdown` too: ``frozen_base``, ``frozen_base_4bit``
    and ``frozen_base_4bit_scales`` (bitsandbytes' packed codes and quantization state), ``adapter_params``,
    ``adapter_grads`` (read before the optimizer step) and ``adapter_optimizer_states``: the planner's adapter rows.

    Each requested step is measured at the first optimizer step at or after it: under manual optimization with two
    optimizers ``global_step`` moves by 2 a batch (0, 2, 4, ...), so ``at_steps=[1]`` measures step 2. Requested steps
    the run never reaches (beyond ``max_steps``) get one warning at the end of fit. A new run (a fit that starts at
    ``global_step`` 0 without a checkpoint) measures afresh; a resumed one keeps the checkpoint's results.

    Args:
        at_steps: optimizer steps (0-based ``global_step``) to measure, or one step as an int. Default (``None``):
            step 1, or step 0 in a 1-step run (``max_steps=1``), so every run of at least one step is measured
            (optimizer states are read after the measured step, so step 0 has them too).
        model_state_fn: ``(trainer, module) -> {"params": bytes, "grads": ..., "optimizer_states": ...}``; default
            :func:`accounted_model_states` (the strategies' per-rank accounting).

    Example::

        trainer = Trainer(callbacks=[MemoryBreakdown(at_steps=[1, 100])])
    """

    def __init__(self, at_steps: Sequence[int] | int | None = None, model_state_fn: ModelStateFn | None = None) -> None:
        key = "callbacks.memory_breakdown.at_steps"
        fix = "use a list of optimizer steps >= 0 (e.g. [1, 100]), one step as an integer, or null (the default)."
        self._default_steps = at_steps is None
        if at_steps is None:
            steps: list[Any] = [1]  # resolved against the run's length at fit start
        elif isinstance(at_steps, int) and not isinstance(at_steps, bool):
            steps = [at_steps]
        elif isinstance(at_steps, (str, bytes)) or not isinstance(at_steps, Iterable):
            raise ConfigError(key, at_steps, fix)
        else:
            steps = list(at_steps)
        if not steps or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps):
            raise ConfigError(key, at_steps, fix)
        if model_state_fn is not None and not callable(model_state_fn):
            raise ConfigError(
                "callbacks.memory_breakdown.model_state_fn", model_state_fn, "use a function (trainer, module) -> dict."
            )
        self.at_steps: list[int] = sorted(set(steps))
        self.model_state_fn = model_state_fn
        self._counter: SavedTensorsCounter | None = None
        self._measuring_step: int | None = None
        self._states: dict[str, int] = {}
        self._restored = False
        self.results: dict[int, dict[str, Any]] = {}

    def _pending(self) -> list[int]:
        """Requested steps not measured yet: a measurement at step m covers every requested step <= m."""
        done = max(self.results, default=-1)
        return [s for s in self.at_steps if s > done]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning restores callback state after `setup` (Trainer._run): only a restore of this run counts.
        self._restored = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 0 and not self._restored:
            self.results = {}  # a new run is measured afresh
        if self._default_steps and trainer.max_steps >= 1:
            self.at_steps = [min(1, trainer.max_steps - 1)]
        self._restored = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._measuring_step != step:
            pending = self._pending()
            if not pending or pending[0] > step:
                return
            self._measuring_step = step
            self._counter = SavedTensorsCounter(params=pl_module.parameters())
            self._states = {}
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
        assert self._counter is not None
        self._counter.start()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._counter is not None:
            self._counter.mark()
            self._counter.stop()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Under manual optimization with several optimizers the first step's call counts (all gradients still set).
        if self._counter is not None and not self._states:
            fn = self.model_state_fn or accounted_model_states
            self._states = dict(fn(trainer, pl_module))
            if has_frozen_params(pl_module):
                self._states["adapter_grads"] = adapter_breakdown(pl_module)["adapter_grads"]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._measuring_step
        if self._counter is None or step is None or trainer.global_step == step:
            return  # still inside the measured optimizer step (accumulation)
        self._counter.stop()
        if self._counter.n_marks == 0:
            # No backward ran in the measured step (training_step returned None, a skipped batch): nothing was
            # measured, so measure the next step instead of recording zeros.
            self._counter = None
            self._measuring_step = None
            return
        fn = self.model_state_fn or accounted_model_states
        # Optimizer states exist only after the step: read them now, grads from before the step.
        states = dict(fn(trainer, pl_module))
        states["grads"] = self._states.get("grads", states.get("grads", 0))
        if has_frozen_params(pl_module):
            states.update(adapter_breakdown(pl_module, trainer.optimizers))
            states["adapter_grads"] = self._states.get("adapter_grads", states["adapter_grads"])
        row: dict[str, Any] = {k: int(v) for k, v in states.items()}
        row["activations"] = int(self._counter.peak)
        row["activations_weight_copies"] = int(self._counter.peak_weight_copy_bytes)
        if pl_module.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(pl_module.device))
            known = row.get("params", 0) + row.get("grads", 0) + row.get("optimizer_states", 0) + row["activations"]
            row["other"] = peak - known
            row["peak_memory_bytes"] = peak
            row["source"] = "CUDA allocator peak + tensor accounting"
        else:
            row["other"] = None
            row["peak_memory_bytes"] = None
            row["source"] = "tensor accounting (CPU: no allocator statistics)"
        asked = [s for s in self._pending() if s <= step]
        self.results[step] = row
        self._counter = None
        self._measuring_step = None
        log_metrics(trainer, _metric_names(row), step=step)
        gib = {k: v / 2**30 for k, v in row.items() if isinstance(v, int)}
        note = f" (requested step {', '.join(map(str, asked))})" if asked and asked != [step] else ""
        rank_zero_info(f"MemoryBreakdown step {step}{note}: " + ", ".join(f"{k} {v:.3f} GiB" for k, v in gib.items()))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        missing = self._pending()
        if missing:
            rank_zero_warn(
                f"MemoryBreakdown: optimizer step(s) {missing} of callbacks.memory_breakdown.at_steps were never "
                f"reached (the run ended at global_step {trainer.global_step}), so nothing was measured for them; "
                "choose steps below trainer.max_steps.",
                category=UserWarning,
            )

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning does not call Callback.teardown when fit raises (trainer/call.py), so clean up here too.
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._counter is not None:
            self._counter.stop()
            self._counter = None
            self._measuring_step = None

    def summary(self) -> dict[str, Any]:
        """``{"memory_breakdown": {...last measured step, rank 0...}, "peak_memory_bytes": int | None}``."""
        if not self.results:
            return {}
        step = max(self.results)
        row = dict(self.results[step])
        row["step"] = step
        # Model states in the strategies' schema ({device, cpu, nvme} per category), so both reports merge.
        for name in ("params", "grads", "optimizer_states"):
            row[name] = {
                "device": row.pop(name, 0),
                "cpu": row.pop(f"{name}_cpu", 0),
                "nvme": row.pop(f"{name}_nvme", 0),
            }
        return {"memory_breakdown": json_safe(row), "peak_memory_bytes": row.get("peak_memory_bytes")}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"results": {str(k): v for k, v in self.results.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.results = {int(k): dict(v) for k, v in state_dict["results"].items()}
        self._restored = True
