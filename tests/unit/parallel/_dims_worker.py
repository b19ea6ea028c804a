"""One rank of a real 2 (data parallel) x 2 (tensor parallel) run on CPU (gloo), started by torch.distributed.run.

Lightning's ModelParallelStrategy builds the device mesh; each rank writes what ParallelDims read from the Trainer,
the sharding its training loader got and the batches it trained on, for tests/unit/parallel/test_dims.py.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=4 tests/unit/parallel/_dims_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_trainopt.callbacks import SpeedMonitor  # noqa: E402
from lightning_trainopt.parallel.dims import ParallelDims  # noqa: E402
from tests.helpers.tiny_fit import tiny_data, tiny_module  # noqa: E402


class Probe(pl.Callback):
    """Records the dims, the loader's sharding and every training batch of this rank."""

    def __init__(self) -> None:
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
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.seen["batches"].append(batch[0].tolist())


def main(out: Path) -> None:
    probe = Probe()
    speed = SpeedMonitor(log_every_n_steps=1, warmup_steps=0, peak_tflops=1.0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[probe, speed],
    )
    trainer.fit(tiny_module(), tiny_data(batch_size=2, seq_len=16))
    seen = {**probe.seen, "throughput": speed.summary()["throughput"]}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
