"""Worker of test_killed_write: start a checkpoint write and stall in the middle of it, to be killed there.

``python _killed_write.py MODE PATH``: ``file`` stalls with the new file in its staging path, not yet swapped in;
``directory`` after one part of a directory checkpoint; ``commit`` between the two renames that swap a new directory
checkpoint in. Prints ``STALLED`` when it is there.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from lightning_trainopt.checkpoint import files
from tests.helpers.one_process import OneProcess


def _stall() -> None:
    print("STALLED", flush=True)
    time.sleep(600)


def main(mode: str, path: str) -> None:
    new = {"w": torch.full((250_000,), 2.0)}
    if mode == "file":

        def write_then_stall(f):
            torch.save(new, f)
            f.flush()
            _stall()

        files.write_file_atomic(path, write_then_stall)
        return

    def write(staging):
        os.makedirs(staging)
        torch.save(new, os.path.join(staging, "part0.pt"))
        if mode == "directory":
            _stall()
        torch.save(new, os.path.join(staging, "part1.pt"))

    if mode == "commit":
        real_replace = os.replace
        calls = []

        def replace_then_stall(src, dst):
            real_replace(src, dst)
            calls.append(src)
            if len(calls) == 1:  # the old checkpoint is moved aside, the new one not yet in
                _stall()

        files.os.replace = replace_then_stall  # type: ignore[assignment]
    files.save_directory_checkpoint(OneProcess(), path, write)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
