"""Multi-process worker for tests/integration/test_adapter_sharding.py (run as a script, 2 CPU processes, gloo).

Usage: python tests/integration/_adapter_sharding_worker.py OUT_JSON CASE [CASE ...]
  CASE: STRATEGY:ADAPTER[:resume], e.g. ``zero3:lora:resume``; STRATEGY: ddp | zero2 | zero3 | fsdp | tp;
  ADAPTER: lora | qlora.
Each case fits a tiny GPT with the adapter for 4 steps (with ``resume``: 2 steps, a checkpoint, and a second fit that
resumes it for 2 more); all cases run one after another in one pair of processes. The optimizer is SGD with momentum:
its update is linear in the gradient, so the fits' losses can be compared closely with a one-process replay (Adam's
first steps amplify rounding). Rank 0 replays the same global batches on one process (the same seed's model and adapter,
from the fit's starting weights) and writes, per case: the fits' losses and the replay's, whether any frozen parameter
changed, the optimizer-state and trainable element counts, whether the resumed fit started from the saved adapters and
step, and the adapters' ``lora_B`` norm at the start (peft initialises it to zero). A case that raises ends the launch;
the cases before it are written.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightning_trainopt.config.rewrite import install_app_rewrites  # noqa: E402
from lightning_trainopt.data.datamodule import TextDataModule  # noqa: E402
from lightning_trainopt.launch.multirun import teardown_distributed  # noqa: E402
from lightning_trainopt.models.config import GPTConfig  # noqa: E402
from lightning_trainopt.models.lit_gpt import LitGPT  # noqa: E402
from lightning_trainopt.transforms.adapters import AdapterSpec  # noqa: E402

CFG = GPTConfig(name="worker", vocab_size=64, n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, max_seq_len=32)
MICRO = 2
LR = 0.5


#: The token ids each saved fit's adapter model scores after the save (``RUN_DIR/adapter_logits.pt``), for the export.
PROBE = torch.arange(2 * 32).reshape(2, 32) % 64


class AdapterGPT(LitGPT):
    """LitGPT with the adapter applied as train.py applies it (``install_app_rewrites``): step 1 of the ordered
    rewrite, at ``configure_model`` (under FSDP2/TP the strategy then builds the model whole, not on the meta device),
    and checkpoints that record the adapter and leave out the frozen base where they can."""

    def __init__(self, adapter: str) -> None:
        super().__init__(CFG, optimizer=partial(torch.optim.SGD, lr=LR, momentum=0.9))
        spec = AdapterSpec(kind=adapter, r=4, alpha=8, dropout=0.0)  # type: ignore[arg-type]
        install_app_rewrites(self, [], adapter=spec)


def gathered(module: torch.nn.Module, zero3: bool, trainable: bool) -> dict[str, torch.Tensor]:
    """The trainable (or frozen) parameters whole, on every rank (collective)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad == trainable]
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in named}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # bytes, not values: a 4-bit weight stored as bf16 holds bit patterns that read as NaN
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a
    )


class Record(pl.Callback):
    def __init__(self, zero3: bool) -> None:
        self.zero3 = zero3
        self.losses: list[float] = []
        self.batches: list[list[torch.Tensor]] = []
        self.start_step = -1
        self.frozen_before: dict[str, torch.Tensor] = {}
        self.frozen_changed: bool | None = None
        self.adapters_start: dict[str, torch.Tensor] = {}
        self.adapters_end: dict[str, torch.Tensor] = {}
        self.state_numel = 0
        self.trainable_numel = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step
        self.frozen_before = gathered(pl_module, self.zero3, trainable=False)
        self.adapters_start = gathered(pl_module, self.zero3, trainable=True)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.batches.append([t.detach().clone() for t in batch])

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self.losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.frozen_changed = not _same(self.frozen_before, gathered(pl_module, self.zero3, trainable=False))
        self.adapters_end = gathered(pl_module, self.zero3, trainable=True)
        self.trainable_numel = sum(p.numel() for p in self.adapters_end.values())
        # SGD's momentum buffers: a DTensor counts its whole size; a ZeRO partition its own piece (summed over ranks).
        optimizer = trainer.optimizers[0]
        states = getattr(optimizer, "optimizer", optimizer).state.values()
        local = sum(s["momentum_buffer"].numel() for s in states if s.get("momentum_buffer") is not None)
        total = torch.tensor(float(local))
        if self.zero3 or isinstance(trainer.strategy, pl.strategies.DeepSpeedStrategy):
            torch.distributed.all_reduce(total)
        self.state_numel = int(total)


def _strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    if name == "fsdp":
        from lightning_trainopt.parallel import TrainOptFSDPStrategy

        return TrainOptFSDPStrategy()
    if name == "tp":
        from lightning_trainopt.parallel.tp_strategy import TrainOptTPStrategy

        return TrainOptTPStrategy(tensor_parallel_size=2)
    from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy

    return TrainOptDeepSpeedStrategy(stage=int(name[-1]), preset=name)


def _fit(strategy: str, adapter: str, max_steps: int, ckpt: str | None, save: str | None) -> Record:
    pl.seed_everything(7, workers=True)
    record = Record(zero3=strategy == "zero3")
    data = TextDataModule(
        corpus="synthetic", seq_len=32, batch_size=MICRO, synthetic_tokens=8192, vocab_size=64, seed=7
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(strategy),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[record],
    )
    module = AdapterGPT(adapter)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
        # The saved adapter model's logits (a collective forward: the sharded weights are gathered), which
        # tests/integration/test_adapter_sharding.py compares with trainopt-export's outputs.
        module.eval()
        with torch.no_grad():
            logits = module.model(PROBE)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        if torch.distributed.get_rank() == 0:
            torch.save(logits.float(), os.path.join(os.path.dirname(os.path.dirname(save)), "adapter_logits.pt"))
    if strategy != "tp":  # each data-parallel rank's loss is its micro-batch's mean: average them
        losses = torch.tensor(record.losses)
        torch.distributed.all_reduce(losses)
        record.losses = (losses / torch.distributed.get_world_size()).tolist()
    all_batches: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(all_batches, record.batches)
    # each step's global batch: the ranks' micro-batches side by side (TP ranks share one)
    ranks = all_batches[:1] if strategy == "tp" else all_batches
    record.batches = [[torch.cat(parts) for parts in zip(*step)] for step in zip(*ranks)]
    return record


def _replay(
    adapter: str,
    batches: list[list[torch.Tensor]],
    adapters: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    load_frozen: bool,
) -> tuple[list[float], bool]:
    """The same seed's model and adapter on one process, from the fit's starting weights (the adapters, and the
    frozen base unless it is 4-bit), trained on the global batches the fits saw: its loss per step, then the first
    batch's loss after the steps; and whether its frozen weights are the fit's (a 4-bit base is quantized by each
    build from the same seed's weights)."""
    pl.seed_everything(7, workers=True)
    module = AdapterGPT(adapter)
    module.configure_model()
    if load_frozen:
        module.load_state_dict(frozen, strict=False)
    module.load_state_dict(adapters, strict=False)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses = []
    for batch in batches:
        loss, _ = module.batch_loss(batch)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # the first batch again, after the steps: the adapters learned
        losses.append(float(module.batch_loss(batches[0])[0]))
    same = _same(frozen, {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad})
    return losses, same


def _next_process_group() -> None:
    """A fresh process group on a fresh port for the next fit (as the memory-techniques worker does)."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    port = [find_free_network_port() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    teardown_distributed()


def run_case(case: str, folder: str) -> dict[str, Any]:
    strategy, adapter, *resume = case.split(":")
    if resume:
        # A run folder as train.py lays it out (RUN_DIR/checkpoints/), which trainopt-export takes.
        ckpt = os.path.join(folder, case.replace(":", "_"), "checkpoints", "last.ckpt")
        first = _fit(strategy, adapter, 2, None, ckpt)
        _next_process_group()
        second = _fit(strategy, adapter, 4, ckpt, None)
    else:
        first = second = _fit(strategy, adapter, 4, None, None)
    resumed_from_saved = _same(first.adapters_end, second.adapters_start)
    replay, same_base = (
        _replay(
            adapter,
            first.batches + second.batches if resume else first.batches,
            first.adapters_start,
            first.frozen_before,
            adapter == "lora",
        )
        if torch.distributed.get_rank() == 0
        else ([], False)
    )
    b_norm = sum(float(p.float().norm()) for n, p in first.adapters_start.items() if "lora_B" in n)
    _next_process_group()
    return {
        "losses": first.losses + second.losses if resume else first.losses,
        "replay": replay,
        "replay_same_base": same_base,
        "frozen_changed": [first.frozen_changed, second.frozen_changed],
        "state_numel": first.state_numel,
        "trainable_numel": first.trainable_numel,
        "frozen_numel": sum(p.numel() for p in first.frozen_before.values()),
        "resumed_step": second.start_step,
        "resumed_from_saved": resumed_from_saved,
        "lora_b_norm_at_start": b_norm,
        "run_dir": os.path.dirname(os.path.dirname(ckpt)) if resume else None,
    }


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    results: dict[str, Any] = {}
    folder = os.environ.setdefault("ADAPTER_WORKER_DIR", tempfile.mkdtemp())
    try:
        for case in cases:
            results[case] = run_case(case, folder)
    finally:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            with open(out, "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    main()
