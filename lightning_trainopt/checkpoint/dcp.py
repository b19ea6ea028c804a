"""Reading a torch distributed checkpoint (DCP) directory on one process, without the ranks that wrote it.

Under FSDP2 (and any DTensor model) Lightning's ``ModelParallelStrategy`` writes a DCP directory: one
``__<rank>_0.distcp`` file per rank, written by all ranks at once, ``.metadata`` (which tensor slice lies where) and
``meta.pt`` (Lightning's loops, hyper-parameters, ...). The layout does not depend on the number of ranks that read
it: DCP reshards on load, so a run resumes on another number of ranks, and one process reads a whole tensor here.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

__all__ = ["DCP_METADATA", "is_dcp_checkpoint", "read_dcp_tensors"]

# torch.distributed.checkpoint's index file, written last by the coordinator rank.
DCP_METADATA = ".metadata"


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (it holds DCP's ``.metadata``)."""
    return (Path(path) / DCP_METADATA).is_file()


def read_dcp_tensors(path: str | os.PathLike[str], prefix: str = "state_dict.") -> dict[str, torch.Tensor]:
    """The whole (unsharded) tensors of a DCP checkpoint whose flattened key starts with ``prefix``, on the CPU.

    Only the tensors asked for are read (``prefix="state_dict."``: the model's weights, not the optimizer state),
    each allocated whole from its recorded size and dtype and filled by ``torch.distributed.checkpoint.load`` from
    every rank's file. Keys are returned without ``prefix`` (``model.embed.weight``).

    Args:
        path: the DCP checkpoint directory.
        prefix: the flattened-key prefix to read; ``""`` reads every tensor (weights and optimizer state).

    Raises:
        ValueError: no tensor of the checkpoint starts with ``prefix``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(os.fspath(path))
    metadata = reader.read_metadata()
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not tensors:
        raise ValueError(f"{path} holds no tensor under {prefix!r}")
    # Flat keys as stored: DCP matches them one to one (a nested dict would be flattened to the same keys).
    with warnings.catch_warnings():
        # DCP's notice that it reads on one process without a process group: exactly what is meant here.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return {key[len(prefix) :]: tensor for key, tensor in tensors.items()}
