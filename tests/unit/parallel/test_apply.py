"""The ordered model rewrite, and the technique x strategy table walked cell by cell."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from lightning_trainopt.config.preflight import PreflightInput, preflight
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.models import GPT
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.parallel.apply import RewritePlan, apply_rewrites
from lightning_trainopt.parallel.compat_table import FAMILIES, TABLE, TECHNIQUES
from lightning_trainopt.parallel.spec import parse_strategy
from lightning_trainopt.precision.fp8_spec import FP8PrecisionSpec
from lightning_trainopt.precision.spec import PrecisionSpec
from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, is_checkpointed
from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss, head_returns_loss
from lightning_trainopt.transforms.compression import Int8Compressor
from lightning_trainopt.transforms.offload import CpuOffloader

SHAPE = GPTConfig(name="apply", vocab_size=64, n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=16)
FP8 = FP8PrecisionSpec(name="fp8", trainer_precision="bf16-mixed", backend="torchao", skip_small=False)
KEEP = PrecisionSpec(name="bf16", trainer_precision="bf16-mixed", keep_fp32=("RMSNorm",))
#: The strategy families a ``StrategySpec`` node selects, for pre-flight.
STRATEGY_NODES: dict[str, dict[str, Any] | None] = {
    "single": None,
    "ddp": {"_target_": "lightning.pytorch.strategies.DDPStrategy", "name": "ddp"},
    "fsdp1": {"_target_": "lightning.pytorch.strategies.FSDPStrategy", "name": "fsdp1"},
    "tp": {"_target_": "lightning_trainopt.parallel.TrainOptTPStrategy", "name": "tp"},
    "fsdp_tp": {"_target_": "lightning_trainopt.parallel.TrainOptTPStrategy", "name": "fsdp_tp"},
}
#: ``(tensor_parallel, world_size)`` of the tensor-parallel families for pre-flight; 1 x 1 for the others.
FAMILY_DIMS = {"tp": (2, 2), "fsdp_tp": (2, 4)}
#: OK cells of DeepSpeed families: not walked here (a DeepSpeed engine needs Lightning's CPU patches); checkpointing
#: under zero1/zero2/zero3 is walked by tests/integration/test_memory_techniques_distributed.py.
#: FSDP1 cannot run on a CPU at all (torch: "FSDP needs a non-CPU accelerator device"; pre-flight refuses it there).
NOT_WALKED_HERE = {(t, f) for t in TECHNIQUES for f in ("zero12", "zero3")} | {
    (t, "fsdp1") for t in TECHNIQUES if TABLE[t]["fsdp1"] is None
}
#: The OK cells of tp and fsdp_tp are walked by tests/unit/parallel/test_tp.py's 4-process worker (a TP mesh).
NOT_WALKED_HERE |= {(t, f) for t in TECHNIQUES for f in ("tp", "fsdp_tp") if TABLE[t][f] is None}
WALKED = {"single", "ddp", "fsdp2"}


def _plan(technique: str, shard: str = "none") -> RewritePlan:
    plans: dict[str, RewritePlan] = {
        "fp8": RewritePlan(precision=FP8, emulate_fp8=True),
        "keep_fp32": RewritePlan(precision=KEEP),
        "checkpoint": RewritePlan(checkpoint=CheckpointPolicy()),
        "offload": RewritePlan(saved_tensors=CpuOffloader(pin_memory=False, min_numel=1)),
        "int8": RewritePlan(saved_tensors=Int8Compressor(min_numel=1)),
        "compile": RewritePlan(compile=True),
        "chunked_ce": RewritePlan(),
    }
    plan = plans[technique]
    return RewritePlan(**{**plan.__dict__, "shard": shard})  # type: ignore[arg-type]


def _step(model: torch.nn.Module, technique: str, wrapper: torch.nn.Module | None = None) -> float:
    """One forward and backward of ``model`` (through ``wrapper`` if given); the loss."""
    torch.manual_seed(0)
    x = torch.randint(0, SHAPE.vocab_size, (2, 16))
    y = torch.randint(0, SHAPE.vocab_size, (2, 16))
    call = wrapper or model
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=technique in ("fp8", "keep_fp32")):
        if technique == "chunked_ce":
            with head_returns_loss(model.lm_head, ChunkedLMHeadLoss(chunk_tokens=8), y):
                loss = call(x)
        else:
            logits = call(x)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads
    assert all(g is not None for g in grads)
    return float(loss.detach())


def test_the_steps_run_in_order_and_the_model_trains():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    plan = RewritePlan(precision=FP8, emulate_fp8=True, checkpoint=CheckpointPolicy(), compile=True)
    report = apply_rewrites(model, plan)
    assert report.steps == ["convert", "activations", "compile"]
    assert type(model.blocks[0].attn.q_proj).__name__ == "Float8Linear"  # converted before anything wrapped it
    assert is_checkpointed(model.blocks[0])
    assert report.compiled == ["blocks.0", "blocks.1"]
    loss = _step(model, "fp8")
    assert torch.isfinite(torch.tensor(loss))


def test_tensor_parallel_is_a_named_step_that_refuses_without_its_mesh():
    with pytest.raises(ConfigError, match=r"strategy.tensor_parallel_size=2"):
        apply_rewrites(GPT(SHAPE), RewritePlan(tensor_parallel=2))


def test_every_refused_cell_is_refused_by_preflight_with_its_reason():
    refused = [(t, f) for t in TECHNIQUES for f in FAMILIES if TABLE[t][f] is not None]
    assert refused  # the walk below has something to check
    for technique, family in refused:
        refusal = TABLE[technique][family]
        assert refusal is not None
        tp, world = FAMILY_DIMS.get(family, (1, 1))
        p = PreflightInput(
            strategy=parse_strategy(STRATEGY_NODES[family]),
            accelerator="gpu",
            techniques=(technique,),
            tensor_parallel=tp,
            world_size=world,
        )
        with pytest.raises(IncompatibleConfigError) as err:
            preflight(p)
        assert refusal.reason in str(err.value)
        assert refusal.fix in str(err.value)


def test_every_ok_cell_passes_preflight():
    for technique in TECHNIQUES:
        for family in ("single", "ddp"):
            assert TABLE[technique][family] is None
            spec = parse_strategy(STRATEGY_NODES[family])
            p = PreflightInput(strategy=spec, accelerator="cpu", techniques=(technique,))
            assert preflight(p) == []  # composes: no refusal and no advice


def test_the_cells_not_walked_are_exactly_the_listed_ones():
    ok = {(t, f) for t in TECHNIQUES for f in FAMILIES if TABLE[t][f] is None}
    assert {(t, f) for t, f in ok if f not in WALKED} == NOT_WALKED_HERE


@pytest.mark.parametrize("technique", [t for t in TECHNIQUES if TABLE[t]["single"] is None])
def test_every_ok_single_cell_composes(technique):
    torch.manual_seed(0)
    model = GPT(SHAPE)
    apply_rewrites(model, _plan(technique))
    assert torch.isfinite(torch.tensor(_step(model, technique)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _walk(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_trainopt.parallel.meta_init import materialize_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    try:
        for family in ("ddp", "fsdp2"):
            for technique in (t for t in TECHNIQUES if TABLE[t][family] is None):
                try:
                    if family == "fsdp2":  # built on the meta device, as TrainOptFSDPStrategy builds our GPT
                        state = torch.get_rng_state()
                        with torch.device("meta"):
                            model = GPT(SHAPE)
                        apply_rewrites(model, _plan(technique, "fsdp2"), mesh)
                        materialize_sharded(model, torch.device("cpu"), state)
                        loss = _step(model, technique)
                    else:
                        model = GPT(SHAPE)
                        apply_rewrites(model, _plan(technique))
                        loss = _step(model, technique, DistributedDataParallel(model))
                    results[(rank, technique, family)] = "ok" if torch.isfinite(torch.tensor(loss)) else "nan"
                except Exception as err:  # recorded per cell, so one failure names its cell
                    results[(rank, technique, family)] = f"{type(err).__name__}: {err}"
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def walked() -> dict:
    results = mp.Manager().dict()
    mp.spawn(_walk, args=(_port(), results), nprocs=2, join=True)
    return dict(results)


def test_every_ok_ddp_and_fsdp2_cell_composes_on_two_processes(walked):
    expected = {
        (rank, t, f): "ok" for rank in (0, 1) for f in ("ddp", "fsdp2") for t in TECHNIQUES if TABLE[t][f] is None
    }
    assert walked == expected
