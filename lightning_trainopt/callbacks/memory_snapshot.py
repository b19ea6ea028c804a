"""MemorySnapshot: CUDA allocator history for a window of steps, and a snapshot with advice on out-of-memory."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt._compat import torch_internals as private
from lightning_trainopt.callbacks._common import find_callback, json_safe, warn_off
from lightning_trainopt.callbacks._oom_advice import oom_advice
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.dims import ParallelDims

__all__ = ["MemorySnapshot"]


class MemorySnapshot(Callback):
    """Writes ``.pickle`` snapshots of the CUDA allocator that https://pytorch.org/memory_viz opens.

    Records allocator history from optimizer step ``start_step`` for ``num_steps`` steps and dumps
    ``snapshot_rank{r}_steps{a}-{b}.pickle``. With ``on_oom`` it records from the start of training (a ring buffer of
    ``max_entries`` events) so that a CUDA out-of-memory error writes ``oom_rank{r}.pickle`` on every rank, plus
    ``oom_rank{r}.json`` with the memory categories at the peak and advice with numbers. Off (one warning) on CPU.

    Args:
        dirpath: output folder (default: ``<trainer.default_root_dir>/memory_snapshots``).
        start_step: first optimizer step of the recorded window; ``None`` records no window.
        num_steps: optimizer steps in the window; a run that ends inside the window dumps at its last step
            (``steps{a}-{last}``), so a short smoke run still writes its snapshot.
        on_oom: record continuously and write a snapshot and advice on out-of-memory.
        max_entries: allocator events kept.

    Example::

        trainer = Trainer(accelerator="gpu", callbacks=[MemorySnapshot(start_step=2, num_steps=3)])
    """

    def __init__(
        self,
        dirpath: str | None = None,
        start_step: int | None = 1,
        num_steps: int = 3,
        on_oom: bool = True,
        max_entries: int = 100_000,
    ) -> None:
        if start_step is not None and (not isinstance(start_step, int) or start_step < 0):
            raise ConfigError("callbacks.memory_snapshot.start_step", start_step, "use an optimizer step >= 0 or null.")
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ConfigError("callbacks.memory_snapshot.num_steps", num_steps, "use a positive integer.")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError("callbacks.memory_snapshot.max_entries", max_entries, "use a positive integer.")
        self.dirpath = dirpath
        self.start_step = start_step
        self.num_steps = num_steps
        self.on_oom = on_oom
        self.max_entries = max_entries
        self.enabled = True
        self._recording = False
        self._window_done = False
        self._window_open = False
        self.files: list[str] = []
        self.oom_report: dict[str, Any] | None = None

    def _dir(self, trainer: pl.Trainer) -> str:
        path = self.dirpath or os.path.join(trainer.default_root_dir, "memory_snapshots")
        os.makedirs(path, exist_ok=True)
        return path

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.strategy.root_device.type != "cuda" or not private.memory_history_supported():
            self.enabled = False
            warn_off("MemorySnapshot", "CUDA allocator history needs a CUDA device.")
            return
        self.enabled = True

    def _start(self) -> None:
        if not self._recording:
            private.start_memory_history(self.max_entries)
            self._recording = True

    def _stop(self) -> None:
        if self._recording:
            private.stop_memory_history()
            self._recording = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window_done = False
        self._window_open = False
        if self.enabled and self.on_oom:
            self._start()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.enabled and self.start_step is not None and trainer.global_step == self.start_step:
            self._start()
            self._window_open = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.enabled or self.start_step is None or self._window_done or not self._window_open:
            return
        step = trainer.global_step
        end = self.start_step + self.num_steps
        run_over = 0 < trainer.max_steps <= step
        if step > self.start_step and (step >= end or run_over):
            last = min(end, step) - 1
            path = os.path.join(
                self._dir(trainer), f"snapshot_rank{trainer.global_rank}_steps{self.start_step}-{last}.pickle"
            )
            private.dump_memory_snapshot(path)
            self.files.append(path)
            self._window_done = True
            self._window_open = False
            if not self.on_oom:
                self._stop()
            rank_zero_info(f"MemorySnapshot: wrote {path} (open it at https://pytorch.org/memory_viz)")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if self.enabled and self._recording and isinstance(exception, torch.cuda.OutOfMemoryError):
                self._write_oom(trainer, pl_module)
        finally:
            # Lightning does not call Callback.teardown when fit raises, so recording would otherwise stay on.
            self._stop()

    def _write_oom(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        folder = self._dir(trainer)
        path = os.path.join(folder, f"oom_rank{rank}.pickle")
        private.dump_memory_snapshot(path)
        self.files.append(path)
        self.oom_report = self._oom_report(trainer, pl_module)
        with open(os.path.join(folder, f"oom_rank{rank}.json"), "w") as fh:
            json.dump(json_safe(self.oom_report), fh, indent=2)
        # Every rank prints: each one ran out on its own device.
        print(f"[rank {rank}] CUDA out of memory; snapshot {path}\n  " + "\n  ".join(self.oom_report["advice"]))

    def _oom_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        from lightning_trainopt.callbacks.memory_breakdown import accounted_model_states

        device = pl_module.device
        states = accounted_model_states(trainer, pl_module)
        peak = int(torch.cuda.max_memory_allocated(device))
        measured = find_callback(trainer, "MemoryBreakdown")
        acts, copies = None, 0
        if measured is not None and measured.results:
            row = measured.results[max(measured.results)]
            acts, copies = row.get("activations"), int(row.get("activations_weight_copies") or 0)
        model = sum(states.get(k, 0) for k in ("params", "grads", "optimizer_states"))
        # Without a measured figure, everything above the model states counts as activations + temporaries.
        activations = int(acts) if acts is not None else max(0, peak - model)
        breakdown = {
            **states,
            "activations": activations,
            "activations_weight_copies": copies,
            "other": peak - model - activations,
            "peak": peak,
        }
        cfg = getattr(pl_module, "config", None)
        loader = trainer.train_dataloader
        advice = oom_advice(
            breakdown,
            device_bytes=torch.cuda.get_device_properties(device).total_memory,
            n_layers=getattr(cfg, "n_layers", None),
            micro_batch=getattr(loader, "batch_size", None),
            accumulate=trainer.accumulate_grad_batches,
            world_size=ParallelDims.from_trainer(trainer).dp,  # ZeRO shards over the replicas, not every rank
        )
        return {
            "breakdown": breakdown,
            "activations_source": "MemoryBreakdown" if acts is not None else "peak minus model states",
            "advice": advice,
        }

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def summary(self) -> dict[str, Any]:
        """``{"memory_snapshot": {"enabled", "files", "oom"}}`` for metrics.json."""
        return {
            "memory_snapshot": json_safe({"enabled": self.enabled, "files": list(self.files), "oom": self.oom_report})
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"files": list(self.files)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.files = list(state_dict["files"])
