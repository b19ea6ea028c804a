"""A callback that records what an adapter run trained: ``+callbacks.adapter_probe._target_=...AdapterProbe``.

Each rank writes ``adapter_probe_rank<N>.json`` into ``path`` when the fit ends: the frozen base's hash at the start
and at the end, the first and last training loss, and which parameters the optimizer holds state for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_trainopt.transforms.adapters import base_state_hash, frozen_base_names


def _key_hashes(module: pl.LightningModule) -> dict[str, str]:
    """Per base tensor, a hash of its bytes: which tensors changed, when the whole-base hash says one did."""
    import hashlib

    from torch.distributed.tensor import DTensor

    state = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}  # this rank's
    return {
        k: hashlib.sha256(state[k].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k in frozen_base_names(module)
        if isinstance(state[k], torch.Tensor) and state[k].numel()
    }


class AdapterProbe(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.losses: list[float] = []
        self.start_hash = ""
        self.start_keys: dict[str, str] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_hash = base_state_hash(pl_module)
        self.start_keys = _key_hashes(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        names = {id(p): n for n, p in pl_module.named_parameters()}
        with_state = sorted(names[id(p)] for opt in trainer.optimizers for p in opt.state if opt.state[p])
        record = {
            "start_hash": self.start_hash,
            "end_hash": base_state_hash(pl_module),
            "changed": sorted(k for k, v in _key_hashes(pl_module).items() if self.start_keys.get(k) != v),
            "losses": self.losses,
            "trainable": sorted(n for n, p in pl_module.named_parameters() if p.requires_grad),
            "with_state": with_state,
            "frozen": sum(1 for p in pl_module.parameters() if not p.requires_grad),
        }
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"adapter_probe_rank{trainer.global_rank}.json").write_text(json.dumps(record))
