"""``train.py`` on two "nodes" of this machine: two torchrun agents meeting at a loopback address."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_nodes(args: list[str], run_dir: Path, cwd: Path = REPO_ROOT, nproc: int = 2) -> list[str]:
    """``train.py ARGS trainer.devices=NPROC trainer.num_nodes=2`` under ``torchrun --nnodes 2`` (``--node-rank`` 0
    and 1, static rendezvous on 127.0.0.1, Lightning's TorchElasticEnvironment); each agent's output. Asserts both
    agents exit 0."""
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                "torchrun",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc_per_node",
                str(nproc),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(REPO_ROOT / "train.py"),
                *args,
                f"trainer.devices={nproc}",
                "trainer.num_nodes=2",
                f"hydra.run.dir={run_dir}",
            ],
            cwd=cwd,
            env=child_env(REPO_ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return outs
