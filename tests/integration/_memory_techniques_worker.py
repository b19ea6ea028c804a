"""Multi-process worker for tests/integration/test_memory_techniques_distributed.py (run as a script).

Usage: python tests/integration/_memory_techniques_worker.py STRATEGY TECHNIQUE MICRO ACCUM OUT_JSON
  STRATEGY: ddp | zero1 | zero2 | zero3 | fsdp2 (2 CPU processes, gloo)
  TECHNIQUE: none | checkpoint | int8 | finder
  env CLIP: gradient_clip_val (clip by norm) for the Trainer; unset: no clipping.
Rank 0 writes: saved-for-backward bytes of the first micro-batch, losses, batch sizes seen, accumulation, the
parameters after the run (fp32, gathered), so the test can compare runs, and the global norm of the update
(parameters after minus before, all of them, gathered), which SGD makes ``lr x`` the (clipped) gradient norm.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing  # noqa: E402
from lightning_trainopt.callbacks.activation_compression import ActivationCompression  # noqa: E402
from lightning_trainopt.callbacks.micro_batch_finder import MicroBatchFinder  # noqa: E402
from lightning_trainopt.core.saved_tensors import SavedTensorsCounter  # noqa: E402
from lightning_trainopt.data.datamodule import TextDataModule  # noqa: E402
from lightning_trainopt.models.config import GPTConfig  # noqa: E402
from lightning_trainopt.models.lit_gpt import LitGPT  # noqa: E402

CFG = GPTConfig(name="worker", vocab_size=64, n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, max_seq_len=32)


class FSDP2LitGPT(LitGPT):
    """LitGPT sharded with FSDP2 (``fully_shard`` per block, then the whole model) in configure_model."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.first_bytes: int | None = None
        self.losses: list[float] = []
        self.sizes: list[int] = []
        self.accumulate: list[int] = []
        self._counter: SavedTensorsCounter | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.sizes.append(int(batch[0].shape[0]))
        self.accumulate.append(int(trainer.accumulate_grad_batches))
        if self.first_bytes is None:
            self._counter = SavedTensorsCounter(params=pl_module.parameters())
            self._counter.start()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach()))
        if self._counter is not None:
            self._counter.stop()
            self.first_bytes = self._counter.report().activation_bytes
            self._counter = None


def full_params(module: pl.LightningModule, strategy: str) -> list[torch.Tensor]:
    """Every parameter whole, fp32, on every rank (ZeRO-3 partitions and FSDP2 DTensors gathered; collective)."""
    params = list(module.parameters())
    if strategy == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().flatten().clone() for p in params]
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten().clone() for p in params]


class UpdateNorm(pl.Callback):
    """Global L2 norm of the change of all parameters over the fit."""

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy
        self.before: list[torch.Tensor] = []
        self.norm: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = full_params(pl_module, self.strategy)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        after = full_params(pl_module, self.strategy)
        self.norm = float(torch.cat([a - b for a, b in zip(after, self.before)]).norm())


def _strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    from lightning_trainopt.strategies import TrainOptDeepSpeedStrategy

    return TrainOptDeepSpeedStrategy(stage=int(name[-1]), preset=name)


def main() -> None:
    strategy, technique, micro, accum, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    pl.seed_everything(7, workers=True)
    record, update = Record(), UpdateNorm(strategy)
    callbacks: list[pl.Callback] = [record, update]
    if technique == "checkpoint":
        callbacks.append(ActivationCheckpointing(module_classes=["Block"]))
    elif technique == "int8":
        callbacks.append(ActivationCompression(min_numel=256))
    elif technique == "finder":
        callbacks.append(MicroBatchFinder(budget_bytes=2**40, max_micro_batch=int(os.environ["FINDER_MAX_MICRO"])))
    cls = FSDP2LitGPT if strategy == "fsdp2" else LitGPT
    module = cls(CFG, optimizer=partial(torch.optim.SGD, lr=0.5))
    data = TextDataModule(
        corpus="synthetic", seq_len=32, batch_size=micro, synthetic_tokens=16384, vocab_size=64, seed=7
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(strategy),
        max_steps=1,
        accumulate_grad_batches=accum,
        gradient_clip_val=float(os.environ["CLIP"]) if os.environ.get("CLIP") else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    params = {}
    for name, p in [] if strategy == "zero3" else module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = full.detach().float().flatten()[:256].tolist()
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump(
                {
                    "first_bytes": record.first_bytes,
                    "losses": record.losses,
                    "sizes": record.sizes,
                    "accumulate": record.accumulate,
                    "global_step": trainer.global_step,
                    "engine_micro": getattr(
                        getattr(trainer.strategy, "deepspeed_engine", None),
                        "train_micro_batch_size_per_gpu",
                        lambda: None,
                    )(),
                    "engine_accumulate": getattr(
                        getattr(trainer.strategy, "deepspeed_engine", None), "gradient_accumulation_steps", lambda: None
                    )(),
                    "params": params,
                    "update_norm": update.norm,
                },
                f,
            )


if __name__ == "__main__":
    main()
