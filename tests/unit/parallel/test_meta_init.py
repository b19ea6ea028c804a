"""FSDP2 builds our GPT on the meta device and initialises each rank's shards to the values of a whole build."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.parallel.meta_init import materialize_sharded

# Odd sizes: the vocabulary (67 rows) does not split evenly over 2 ranks, so FSDP2 pads rank 1's shard.
SHAPE = GPTConfig(name="meta", vocab_size=67, n_layers=2, d_model=32, n_heads=2, ffn_hidden=48, max_seq_len=16)
SEED = 1234


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(SEED)
        eager = GPT(SHAPE)
        after_eager = torch.get_rng_state()
        torch.manual_seed(SEED)
        state = torch.get_rng_state()
        with torch.device("meta"):
            model = GPT(SHAPE)
        torch.manual_seed(999)  # whatever ran between the build and the replay
        mesh = init_device_mesh("cpu", (2,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        n = materialize_sharded(model, torch.device("cpu"), state)
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        results[rank] = {
            "n": n,
            "equal": [name for name, p in eager.named_parameters() if torch.equal(p, full[name])],
            "names": [name for name, _ in eager.named_parameters()],
            "rng_as_after_eager": torch.equal(torch.get_rng_state(), after_eager),
            "local_rows": model.embed.weight.to_local().shape[0],
            "tied": model.lm_head.weight is model.embed.weight,
        }
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results() -> dict:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(_port(), results), nprocs=2, join=True)
    return dict(results)


def test_each_rank_holds_its_shard_of_the_same_weights_as_a_whole_build(sharded_results):
    for rank in (0, 1):
        got = sharded_results[rank]
        assert got["equal"] == got["names"]  # every parameter, bit for bit
        assert got["n"] == len(got["names"])
        assert got["tied"]
        assert got["rng_as_after_eager"]  # later draws (dropout, data order) match a whole build's too
    assert (sharded_results[0]["local_rows"], sharded_results[1]["local_rows"]) == (34, 33)


def test_a_module_nothing_initialises_is_refused():
    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        root = torch.nn.Sequential(Bare())
    with pytest.raises(ConfigError, match="nothing initialises"):
        materialize_sharded(root, torch.device("cpu"))


def test_an_unsharded_meta_model_gets_the_eager_values():
    torch.manual_seed(SEED)
    eager = GPT(SHAPE)
    torch.manual_seed(SEED)
    state = torch.get_rng_state()
    with torch.device("meta"):
        holder = torch.nn.ModuleDict({"model": GPT(SHAPE)})
    materialize_sharded(holder, torch.device("cpu"), state)
    for (name, p), q in zip(holder["model"].named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q), name
