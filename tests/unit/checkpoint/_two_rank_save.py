"""Worker of test_checkpoint_files: two gloo ranks write one directory checkpoint; rank 1's part fills the disk."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from lightning_trainopt.checkpoint.files import save_directory_checkpoint
from lightning_trainopt.exceptions import CheckpointWriteError


class GlooStrategy:
    """The four calls save_directory_checkpoint makes of a Lightning strategy, over a real process group."""

    def __init__(self, rank: int) -> None:
        self.is_global_zero = rank == 0

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce_boolean_decision(self, decision, all=True):
        flag = torch.tensor(int(bool(decision)))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX)
        return bool(flag.item())

    def barrier(self, name=None):
        dist.barrier()


def main(rank: int, final: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    n = {0: 1000, 1: 400_000}[rank]  # rank 1: 1.6 MB on a 1 MiB disk

    def write(staging):
        os.makedirs(staging, exist_ok=True)
        # Rank 0 writes its small part before rank 1 fills the disk: otherwise rank 0 may hit the full disk itself.
        if rank == 1:
            dist.barrier()
        torch.save({"w": torch.zeros(n)}, os.path.join(staging, f"shard{rank}.pt"))
        if rank == 0:
            dist.barrier()

    try:
        save_directory_checkpoint(GlooStrategy(rank), final, write)
    except CheckpointWriteError as err:
        print(f"rank {rank}: {err}", flush=True)
    else:
        print(f"rank {rank}: committed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
