"""Worker of test_export: one optimizer step of a tiny GPT with LoRA on 2 gloo ranks under DeepSpeed ZeRO-3, then
FSDP2, each saving its sharded checkpoint (or, with ``single``, the same step on 1 process into a ``.ckpt`` file).

``python _export_worker.py OUT_DIR [single]``: writes ``OUT_DIR/zero3.ckpt/`` and ``OUT_DIR/fsdp2.ckpt/`` (or
``OUT_DIR/single.ckpt``). Both cases run in one pair of processes (Lightning's launcher re-runs this script for
rank 1 at the first fit), each from the same seed, on the same global batch as the single run: the data set's 4
sequences, however a sampler splits them.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from lightning_trainopt.launch.multirun import teardown_distributed
from lightning_trainopt.models import GPTConfig, LitGPT  # noqa: E402

SHAPE = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=16)
TARGETS = ["q_proj", "v_proj", "down_proj"]
R, ALPHA = 4, 16


class LoraGPT(LitGPT):
    """LitGPT built whole in ``__init__`` with a LoRA adapter (peft, in place); only the adapter is optimized."""

    def __init__(self) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        super().__init__(SHAPE, optimizer=partial(torch.optim.SGD, lr=0.5))
        super().configure_model()
        # init_lora_weights=False: B random, so the merge matters from the start.
        inject_adapter_in_model(
            LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False), self.model
        )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


def _strategy(name: str) -> Any:
    if name == "zero3":
        from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy

        return TrainOptDeepSpeedStrategy(stage=3, preset="zero3")
    if name == "fsdp2":
        from lightning_trainopt.parallel import TrainOptFSDPStrategy

        return TrainOptFSDPStrategy()
    return "auto"


def fit(name: str, out: str) -> pl.Trainer:
    """One optimizer step under ``name`` (zero3, fsdp2 or single), then ``save_checkpoint`` from every rank."""
    devices = 1 if name == "single" else 2
    pl.seed_everything(0)
    module = LoraGPT()
    tokens = torch.randint(0, SHAPE.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4 // devices)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=_strategy(name),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=data)
    trainer.save_checkpoint(os.path.join(out, f"{name}.ckpt"))
    print(f"rank {trainer.global_rank}: {name} saved step {trainer.global_step}", flush=True)
    return trainer


def main(out: str, single: bool) -> None:
    if single:
        fit("single", out)
        return
    from tests.integration._memory_techniques_worker import _next_process_group

    fit("zero3", out)
    _next_process_group()
    fit("fsdp2", out)
    teardown_distributed()  # leave no gloo thread joinable at exit (an abort, exit -6, otherwise)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[-1] == "single")
