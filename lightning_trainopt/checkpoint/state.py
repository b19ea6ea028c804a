"""Lightning's own state in a checkpoint (loops, epoch, step) read without its weights, for any strategy's layout."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["lightning_state", "saved_loader_states"]

# Where each strategy keeps the non-tensor Lightning state of a checkpoint directory: DeepSpeed's model-states file of
# model-parallel rank 0 (Lightning passes it as client state; under ZeRO-3 every data-parallel rank writes its own,
# rank 0's named zero_pp_rank_0_...), Lightning's ModelParallelStrategy (our FSDP2) meta file.
_STATE_FILES = (
    "checkpoint/mp_rank_00_model_states.pt",
    "checkpoint/zero_pp_rank_0_mp_rank_00_model_states.pt",
    "meta.pt",
)


def lightning_state(path: str | Path) -> Mapping[str, Any]:
    """The top-level dict Lightning saved (``loops``, ``epoch``, ``global_step``, ...) in a checkpoint file or folder.

    Loaded with ``mmap=True``: the tensors in the file are mapped, not read, so a large model's checkpoint costs no
    memory here.

    Raises:
        FileNotFoundError: a directory that holds none of the known state files.
    """
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in _STATE_FILES if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"{path} holds none of {', '.join(_STATE_FILES)}: not a checkpoint this app wrote")
        path = found[0]
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return state if isinstance(state, Mapping) else {}


def saved_loader_states(path: str | Path) -> list[Mapping[str, Any]]:
    """The training loaders' ``state_dict()`` the checkpoint saved (Lightning's fit loop ``combined_loader``).

    Empty when the loaders had no state (a data module without a resumable loader) or the checkpoint has no loops.
    """
    loops = lightning_state(path).get("loops") or {}
    saved = (loops.get("fit_loop") or {}).get("state_dict") or {}
    states = saved.get("combined_loader") or []
    return [s for s in states if isinstance(s, Mapping)]
