"""One rank of a real 2 (data parallel) x 2 (tensor parallel) run on CPU (gloo), started by torch.distributed.run,
then of a DDP run on the same 4 processes.

Lightning's ModelParallelStrategy builds the device mesh, with our sampler arguments (``DimsSampling``: from
ParallelDims); each rank writes what ParallelDims read from the Trainer, the sharding its training loader got, what
Lightning's own strategy would have given and the batches it trained on, for tests/unit/parallel/test_dims.py. The
DDP run (``TrainOptDDPStrategy``, the ``ddp`` preset's class) records the same beside Lightning's DDPStrategy's own.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=4 tests/unit/parallel/_dims_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_trainopt.callbacks import SpeedMonitor  # noqa: E402
from lightning_trainopt.launch.multirun import teardown_distributed
from lightning_trainopt.parallel.ddp import DimsSampling, TrainOptDDPStrategy  # noqa: E402
from lightning_trainopt.parallel.dims import ParallelDims  # noqa: E402
from tests.helpers.tiny_fit import tiny_data, tiny_module  # noqa: E402


class DimsModelParallel(DimsSampling, ModelParallelStrategy):
    """Lightning's tensor-parallel strategy with the sampler arguments our strategies take from ParallelDims."""


class Probe(pl.Callback):
    """Records the dims, the loader's sharding (and what Lightning's own ``stock`` class would give) and every
    training batch of this rank."""

    def __init__(self, stock: type) -> None:
        self.stock = stock
        self.seen: dict[str, Any] = {"batches": []}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dims = ParallelDims.from_trainer(trainer)
        sampler = trainer.train_dataloader.sampler
        self.seen.update(
            rank=trainer.global_rank,
            dims=dims.to_dict(),
            world_size=dims.world_size,
            dp=dims.dp,
            dp_rank=dims.dp_rank(trainer.global_rank),
            sampler={"num_replicas": sampler.num_replicas, "rank": sampler.rank},
            lightning_sampler=self.stock.distributed_sampler_kwargs.fget(trainer.strategy),
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.seen["batches"].append(batch[0].tolist())


def _fit(strategy: Any, stock: type, callbacks: list[Any]) -> tuple[pl.Trainer, Probe]:
    probe = Probe(stock)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[probe, *callbacks],
    )
    trainer.fit(tiny_module(), tiny_data(batch_size=2, seq_len=16))
    return trainer, probe


def main(out: Path) -> None:
    speed = SpeedMonitor(log_every_n_steps=1, warmup_steps=0, peak_tflops=1.0)
    trainer, probe = _fit(
        DimsModelParallel(data_parallel_size=2, tensor_parallel_size=2), ModelParallelStrategy, [speed]
    )
    seen = {**probe.seen, "throughput": speed.summary()["throughput"]}
    # The same processes again under DDP (the process group is kept): every rank its own replica, as before.
    _, ddp = _fit(TrainOptDDPStrategy(), DDPStrategy, [])
    seen["ddp"] = ddp.seen
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))
    teardown_distributed()  # leave no gloo thread joinable at exit (an abort, exit -6, otherwise)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
