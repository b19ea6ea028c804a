"""``CheckpointIO`` whose single-file saves never leave a half-written checkpoint at the target path."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import PathLike
from lightning_trainopt.checkpoint.files import write_file_atomic

__all__ = ["AtomicCheckpointIO", "use_atomic_checkpoint_io"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes into a staging file in the target's directory, fsyncs it, then ``os.replace``-s it in.

    Lightning's own ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lies in ``/tmp``;
    when the checkpoint folder is on another filesystem, the final move copies straight into the final name, so a
    full disk left a truncated ``last.ckpt``. Here a failed write leaves nothing but the previous checkpoint, and
    raises :class:`~lightning_trainopt.exceptions.CheckpointWriteError` naming the file and the reason (ENOSPC).
    Remote paths (``s3://``, ...) keep Lightning's behaviour.

    Example::

        DDPStrategy(checkpoint_io=AtomicCheckpointIO())
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        if storage_options is not None or type(get_filesystem(path)).__name__ != "LocalFileSystem":
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        write_file_atomic(path, lambda f: torch.save(checkpoint, f))


def use_atomic_checkpoint_io(strategy: Any) -> None:
    """Give ``strategy`` an :class:`AtomicCheckpointIO` where it would use Lightning's plain ``TorchCheckpointIO``.

    A strategy with a checkpoint IO of its own kind (async, remote, a user's) keeps it. (Lightning's
    ``checkpoint_io`` property makes the plain one on first access where none was given.) The DeepSpeed and FSDP2
    strategies write their directory checkpoints through
    :func:`~lightning_trainopt.checkpoint.files.save_directory_checkpoint`, not through this.
    """
    current: CheckpointIO = strategy.checkpoint_io
    if type(current) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
