"""``CheckpointIO`` whose single-file saves never leave a half-written checkpoint at the target path."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_trainopt._compat.lightning_internals import PathLike
from lightning_trainopt.checkpoint.files import commit_staged, discard_staged, staging_path

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes to a staging file next to the target, then ``os.replace``-s it in (used by the ``ddp`` preset).

    Example::

        DDPStrategy(checkpoint_io=AtomicCheckpointIO())
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        staging = staging_path(path)
        try:
            super().save_checkpoint(checkpoint, staging, storage_options)
        except BaseException:
            discard_staged(staging)
            raise
        commit_staged(staging, path)
