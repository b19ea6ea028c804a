"""Worker of test_dcp_checkpoints: train a tiny GPT under FSDP2 on N processes (or only load a checkpoint), save.

``python _reshard_worker.py DEVICES STEPS SAVE [LOAD] [tp]``: fit ``STEPS`` optimizer steps (from ``LOAD`` when
given; with ``LOAD`` at step ``STEPS`` nothing is trained, the checkpoint is only loaded onto this run's ranks), then
``trainer.save_checkpoint(SAVE)`` from every rank. ``tp``: tensor parallel over all ``DEVICES`` instead of FSDP2.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_trainopt.launch.multirun import teardown_distributed
from lightning_trainopt.models import GPTConfig, LitGPT
from lightning_trainopt.parallel import TrainOptFSDPStrategy, TrainOptTPStrategy


def main(devices: int, steps: int, save: str, load: str | None, tp: bool) -> None:
    pl.seed_everything(0)
    tokens = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(0))
    # The global batch is 4 sequences whatever the layout (tensor-parallel ranks read the same batch).
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4 if tp else 4 // devices)
    module = LitGPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=16))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=TrainOptTPStrategy(tensor_parallel_size=devices) if tp else TrainOptFSDPStrategy(),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=data, ckpt_path=load)
    trainer.save_checkpoint(save)
    print(f"rank {trainer.global_rank}: saved step {trainer.global_step}", flush=True)
    # Without this the gloo threads are still joinable when the interpreter exits: CI saw one rank abort with
    # "terminate called without an active exception" (exit -6) after its work was done. train.py does the same.
    teardown_distributed()


if __name__ == "__main__":
    tp = sys.argv[-1] == "tp"
    args = sys.argv[1:-1] if tp else sys.argv[1:]
    main(int(args[0]), int(args[1]), args[2], args[3] if len(args) > 3 else None, tp)
