"""Multi-process worker for tests/integration/test_memory_techniques_distributed.py (run as a script).

Usage: python tests/integration/_memory_techniques_worker.py OUT_JSON CASE [CASE ...]
  CASE: STRATEGY:TECHNIQUE:MICRO:ACCUM[:clip=C][:max_micro=M], e.g. ``zero2:finder:4:1:max_micro=2``
  STRATEGY: ddp | zero1 | zero2 | zero3 | fsdp2 (2 CPU processes, gloo)
  TECHNIQUE: none | checkpoint | int8 | finder
  clip=C: gradient_clip_val (clip by norm) for the Trainer; absent: no clipping.
  max_micro=M: the MicroBatchFinder's max_micro_batch (TECHNIQUE finder).
The cases are fitted one after another in one pair of processes (Lightning's launcher re-runs this script with the
same arguments for rank 1 on the first fit), each from the same seed, so a case's figures are those of a launch of its
own. Rank 0 writes one JSON object mapping each CASE to: saved-for-backward bytes of the first micro-batch, losses,
batch sizes seen, accumulation, the parameters after the run (fp32, gathered), so the test can compare runs, and the
global norm of the update (parameters after minus before, all of them, gathered), which SGD makes ``lr x`` the
(clipped) gradient norm. A case that raises ends the launch; the cases before it are written.
"""

from __future__ import annotations

import gc
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
from lightning_trainopt.data.datamodule import TextDataModule  # noqa: E402
from lightning_trainopt.launch.multirun import teardown_distributed  # noqa: E402
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter  # noqa: E402
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
    from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy

    return TrainOptDeepSpeedStrategy(stage=int(name[-1]), preset=name)


def _parse(case: str) -> dict[str, Any]:
    strategy, technique, micro, accum, *options = case.split(":")
    named = dict(option.split("=", 1) for option in options)
    unknown = set(named) - {"clip", "max_micro"}
    if unknown:
        raise SystemExit(f"case {case!r}: unknown option(s) {sorted(unknown)}; use clip=C and max_micro=M")
    return {
        "strategy": strategy,
        "technique": technique,
        "micro": int(micro),
        "accum": int(accum),
        "clip": float(named["clip"]) if "clip" in named else None,
        "max_micro": int(named["max_micro"]) if "max_micro" in named else None,
    }


def fit_case(case: str) -> tuple[dict[str, Any], bool]:
    """Fit one case; its figures and whether this is rank 0."""
    c = _parse(case)
    strategy = c["strategy"]
    pl.seed_everything(7, workers=True)
    record, update = Record(), UpdateNorm(strategy)
    callbacks: list[pl.Callback] = [record, update]
    if c["technique"] == "checkpoint":
        callbacks.append(ActivationCheckpointing(module_classes=["Block"]))
    elif c["technique"] == "int8":
        callbacks.append(ActivationCompression(min_numel=256))
    elif c["technique"] == "finder":
        callbacks.append(MicroBatchFinder(budget_bytes=2**40, max_micro_batch=c["max_micro"]))
    cls = FSDP2LitGPT if strategy == "fsdp2" else LitGPT
    module = cls(CFG, optimizer=partial(torch.optim.SGD, lr=0.5))
    data = TextDataModule(
        corpus="synthetic", seq_len=32, batch_size=c["micro"], synthetic_tokens=16384, vocab_size=64, seed=7
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(strategy),
        max_steps=1,
        accumulate_grad_batches=c["accum"],
        gradient_clip_val=c["clip"],
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
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    return {
        "first_bytes": record.first_bytes,
        "losses": record.losses,
        "sizes": record.sizes,
        "accumulate": record.accumulate,
        "global_step": trainer.global_step,
        "engine_micro": engine.train_micro_batch_size_per_gpu() if engine is not None else None,
        "engine_accumulate": engine.gradient_accumulation_steps() if engine is not None else None,
        "params": params,
        "update_norm": update.norm,
    }, trainer.is_global_zero


def _next_process_group() -> None:
    """Tear the process group down so the next case's fit initialises a fresh one, on a fresh port.

    As in ``bench/strategies.py --single``: the launcher's environment stays, so the next fit joins the same ranks;
    DeepSpeed's groups are released with its own call (``teardown_distributed``), and a store left on the old port
    would hand the new group stale peer addresses, so rank 0 picks a free port and broadcasts it first.
    """
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    port = [find_free_network_port() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    teardown_distributed()
    gc.collect()


def main(out: str, cases: list[str]) -> None:
    results: dict[str, Any] = {}
    for case in cases:
        result, rank_zero = fit_case(case)
        if rank_zero:
            results[case] = result
            with open(out, "w") as f:  # after every case, so a case that fails leaves the ones before it
                json.dump(results, f)
        _next_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
