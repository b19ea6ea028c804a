"""ParallelDims: validation, the layout read from a strategy, and every figure counting replicas, not ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from omegaconf import OmegaConf

from lightning_trainopt.callbacks import CostMonitor, MicroBatchFinder, SpeedMonitor
from lightning_trainopt.config.run_spec import DataSpec
from lightning_trainopt.data.resumable_loader import ResumableDataLoader
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.launch.run_clock import RunClock
from lightning_trainopt.launch.train import _collect_metrics
from lightning_trainopt.metrics.flops import transformer_flops
from lightning_trainopt.parallel import DimsSampling, ParallelDims
from lightning_trainopt.planner import PlanInputs, StrategyLayout, estimate_plan
from lightning_trainopt.planner.result import estimate_dict
from tests.helpers.tiny_fit import TINY, ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock

ROOT = Path(__file__).resolve().parents[3]
# Two replicas of two tensor-parallel ranks each: every figure must count 2 replicas, never 4 ranks.
DP2_TP2 = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=4)


class FakeMesh:
    """A named device mesh of the given sizes (what ``DeviceMesh`` offers ParallelDims: names, sub-meshes, size)."""

    def __init__(self, **sizes: int) -> None:
        self.mesh_dim_names = tuple(sizes) or None
        self.sizes = sizes

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: self.sizes[name])

    def size(self) -> int:
        return int(torch.tensor(list(self.sizes.values())).prod())


class MeshStrategy:
    """A strategy with a device mesh and Lightning's ModelParallelStrategy sampler arguments."""

    def __init__(self, mesh: FakeMesh | None, world_size: int, global_rank: int = 0, sampler: Any = None) -> None:
        self._mesh = mesh
        self.world_size = world_size
        self.global_rank = global_rank
        self._sampler = sampler

    @property
    def device_mesh(self) -> FakeMesh:
        if self._mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._mesh

    @property
    def distributed_sampler_kwargs(self) -> Any:
        return self._sampler


def test_dims_of_a_world_split_into_tensor_parallel_groups():
    dims = ParallelDims.from_world(world_size=8, tp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp, dims.devices_per_replica) == (1, 4, 2, 4, 2)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert dims.sampler_kwargs(5) == {"num_replicas": 4, "rank": 2}
    assert dims.to_dict() == {"dp_replicate": 1, "dp_shard": 4, "tp": 2}
    hsdp = ParallelDims.from_world(world_size=8, tp=2, dp_replicate=2)
    assert (hsdp.dp_shard, hsdp.dp, hsdp.dp_rank(7)) == (2, 4, 3)
    assert ParallelDims.from_world(world_size=3).dp == 3  # no tensor parallelism: every rank a replica
    with pytest.raises(ValueError, match="global rank 8 is outside a world of 8 ranks"):
        dims.dp_rank(8)


def test_an_indivisible_world_is_refused_naming_the_keys_and_the_fix():
    with pytest.raises(IncompatibleConfigError) as err:
        ParallelDims.from_config(devices=3, num_nodes=1, tp=2)
    assert "trainer.devices=3 x num_nodes=1 is not divisible by tp=2" in str(err.value)
    assert err.value.keys == {"trainer.devices": 3, "trainer.num_nodes": 1, "strategy.tensor_parallel_size": 2}
    assert "a multiple of 2" in err.value.fix
    with pytest.raises(IncompatibleConfigError, match="not divisible by dp_replicate=3 x tp=2"):
        ParallelDims.from_config(devices=4, num_nodes=1, tp=2, dp_replicate=3)
    with pytest.raises(IncompatibleConfigError, match="set strategy.data_parallel_size=4") as err:
        ParallelDims.from_config(devices=4, num_nodes=2, tp=2, dp_shard=3)
    assert err.value.keys["strategy.data_parallel_size"] == 3


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"devices": 0}, "trainer.devices"),
        ({"devices": True}, "trainer.devices"),
        ({"devices": 2, "num_nodes": "2"}, "trainer.num_nodes"),
        ({"devices": 2, "tp": -1}, "strategy.tensor_parallel_size"),
        ({"devices": 2, "dp_shard": 0}, "strategy.data_parallel_size"),
    ],
)
def test_a_size_that_is_not_a_positive_whole_number_is_refused(kwargs, key):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(**kwargs)
    assert err.value.key == key


@pytest.mark.parametrize("reserved", ["cp", "pp"])
def test_context_and_pipeline_parallelism_are_reserved_and_refused(reserved):
    with pytest.raises(IncompatibleConfigError, match="parallelism is not supported yet") as err:
        ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=2, **{reserved: 2})
    assert err.value.keys == {f"parallel_dims.{reserved}": 2}


def test_sizes_whose_product_is_not_the_world_are_refused():
    with pytest.raises(IncompatibleConfigError, match=r"2 x dp_shard=2 x tp=2 = 8 ranks, not the world size 4"):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=4)


def test_dims_from_a_lightning_model_parallel_mesh():
    mesh = FakeMesh(data_parallel=2, tensor_parallel=2)
    sampler = {"num_replicas": 2, "rank": 1}  # what ModelParallelStrategy gives global rank 3
    assert ParallelDims.from_strategy(MeshStrategy(mesh, 4, global_rank=3, sampler=sampler)) == DP2_TP2
    titan = FakeMesh(dp_replicate=2, dp_shard=2, tp=2)
    assert ParallelDims.from_mesh(titan).to_dict() == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}


class TensorParallelStrategy(DimsSampling, MeshStrategy):
    """A 2 (data parallel) x 2 (tensor parallel) strategy whose sampler arguments come from ParallelDims."""


def test_our_sampler_gives_the_ranks_of_one_tensor_parallel_group_one_replica():
    mesh = FakeMesh(data_parallel=2, tensor_parallel=2)
    ranks = [TensorParallelStrategy(mesh, 4, global_rank=r) for r in range(4)]
    assert [s.distributed_sampler_kwargs for s in ranks] == [{"num_replicas": 2, "rank": rep} for rep in (0, 0, 1, 1)]
    # The train-start check agrees with it (a sampler by rank is refused: the test below).
    assert all(ParallelDims.from_strategy(s) == DP2_TP2 for s in ranks)
    # Without a mesh (DDP, DeepSpeed; FSDP2 before set-up) every rank is a replica, as Lightning's DDP shards.
    assert TensorParallelStrategy(None, 4, global_rank=3).distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}


def test_every_strategy_the_app_builds_takes_its_sampler_from_parallel_dims():
    from lightning_trainopt.parallel import TrainOptDDPStrategy, TrainOptDeepSpeedStrategy, TrainOptFSDPStrategy

    for cls in (TrainOptDDPStrategy, TrainOptDeepSpeedStrategy, TrainOptFSDPStrategy):
        assert cls.distributed_sampler_kwargs is DimsSampling.distributed_sampler_kwargs, cls
    preset = OmegaConf.load(ROOT / "lightning_trainopt" / "conf" / "strategy" / "ddp.yaml")
    assert preset._target_ == "lightning_trainopt.parallel.TrainOptDDPStrategy"


def test_a_strategy_without_a_mesh_makes_every_rank_a_replica():
    ddp = SimpleNamespace(world_size=4, global_rank=2, distributed_sampler_kwargs={"num_replicas": 4, "rank": 2})
    assert ParallelDims.from_strategy(ddp) == ParallelDims(dp_replicate=1, dp_shard=4, tp=1, world_size=4)
    # ModelParallelStrategy before setup has no mesh yet: its world is not split.
    assert ParallelDims.from_strategy(MeshStrategy(None, 1)).dp == 1
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace())
    assert ParallelDims.from_trainer(trainer).dp == 2


def test_a_sampler_that_shards_over_ranks_instead_of_replicas_is_refused():
    mesh = FakeMesh(data_parallel=2, tensor_parallel=2)
    by_rank = MeshStrategy(mesh, 4, global_rank=3, sampler={"num_replicas": 4, "rank": 3})
    with pytest.raises(IncompatibleConfigError, match="the sampler would shard otherwise") as err:
        ParallelDims.from_strategy(by_rank)
    assert "{'num_replicas': 2, 'rank': 1} on global rank 3" in str(err.value)


@pytest.mark.parametrize(
    ("mesh", "world", "match"),
    [
        (FakeMesh(), 4, "has no dimension names"),
        (FakeMesh(data_parallel=2, context_parallel=2), 4, "'context_parallel' is not one this package knows"),
        (FakeMesh(data_parallel=2, tensor_parallel=2), 8, "holds 4 ranks, not the world size 8"),
    ],
)
def test_a_mesh_that_does_not_describe_the_world_is_refused(mesh, world, match):
    with pytest.raises(IncompatibleConfigError, match=match):
        ParallelDims.from_strategy(MeshStrategy(mesh, world))


# --- every figure of a dp=2 x tp=2 run on 4 ranks counts 2 replicas --------------------------------------------


def test_the_ranks_of_one_tensor_parallel_group_read_the_same_samples():
    data = list(range(64))
    order = [list(ResumableDataLoader(data, batch_size=4, seed=7, **DP2_TP2.sampler_kwargs(r))) for r in range(4)]
    flat = [torch.cat(batches).tolist() for batches in order]
    assert flat[0] == flat[1]
    assert flat[2] == flat[3]
    assert set(flat[0]).isdisjoint(flat[2])
    assert sorted(flat[0] + flat[2]) == data  # two replicas read the epoch once between them


@pytest.fixture(scope="module")
def dp2_tp2_fit() -> dict[str, Any]:
    """One tiny fit (4 optimizer steps of 4 x 16 tokens, 2 s each) whose Trainer says dp=2, tp=2 on 4 ranks."""
    patch = pytest.MonkeyPatch()
    patch.setattr(ParallelDims, "from_trainer", classmethod(lambda cls, trainer: DP2_TP2))
    try:
        clock = StepClock(dt=2.0)
        speed = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=0, clock=clock)
        cost = CostMonitor(price_per_device_hour=9.0, clock=clock)
        finder = MicroBatchFinder(budget_bytes=2**40)
        logger = ListLogger()
        trainer = tiny_trainer([finder, clock, speed, cost], max_steps=4, logger=logger)
        trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    finally:
        patch.undo()
    return {"speed": speed, "cost": cost, "finder": finder, "logger": logger}


def test_tokens_per_second_and_mfu_count_replicas(dp2_tp2_fit):
    flops = transformer_flops(TINY, 16, 4).train  # one replica's micro-batch, shared by its 2 devices
    logger = dp2_tp2_fit["logger"]
    # 64 tokens per replica per 2 s window step: 2 replicas make 64 tokens/s in all, 16 per device (of 4).
    assert logger.values("throughput/tokens_per_s_total") == [64.0, 64.0]
    assert logger.values("throughput/tokens_per_s") == [16.0, 16.0]
    assert logger.values("throughput/samples_per_s_total") == [4.0, 4.0]
    assert logger.values("throughput/mfu") == [2 * flops / 2 / 4 / 1e6] * 2
    summary = dp2_tp2_fit["speed"].summary()["throughput"]
    assert summary["tokens_per_s_total"] == 64.0
    assert summary["mfu"] == 4 * flops / 2 / 8 / 1e6


def test_dollars_bill_every_device_and_count_every_replicas_tokens(dp2_tp2_fit):
    cost = dp2_tp2_fit["cost"].summary()["cost"]
    # 8 s on 4 devices at $9/device-hour; 4 steps x 64 tokens on each of 2 replicas.
    assert cost["device_hours"] == 8 * 4 / 3600
    assert cost["dollars"] == pytest.approx(8 * 4 / 3600 * 9.0, rel=1e-12)
    assert cost["tokens"] == 4 * 64 * 2
    assert cost["samples"] == 4 * 4 * 2
    assert cost["dollars_per_1b_tokens"] == pytest.approx(cost["dollars"] / 512 * 1e9, rel=1e-12)


def test_the_micro_batch_finder_keeps_the_replicas_global_batch(dp2_tp2_fit):
    plan = dp2_tp2_fit["finder"].plan
    assert plan is not None
    assert (plan.global_batch, plan.world_size, plan.micro_batch * plan.accumulate) == (8, 2, 4)


def test_metrics_json_reports_the_data_parallel_size_beside_the_world_size():
    mesh = FakeMesh(data_parallel=2, tensor_parallel=2)
    strategy = MeshStrategy(mesh, 4, global_rank=0, sampler={"num_replicas": 2, "rank": 0})
    trainer = SimpleNamespace(
        world_size=4,
        num_devices=4,
        strategy=strategy,
        accelerator=CPUAccelerator(),
        accumulate_grad_batches=3,
        global_step=5,
        callbacks=[],
        callback_metrics={},
        datamodule=SimpleNamespace(batch_size=4, seq_len=16),
    )
    times = iter([0.0, 10.0])
    clock = RunClock(clock=lambda: next(times))
    clock.on_train_start(trainer, None)
    for _ in range(15):  # 5 optimizer steps of 3 micro-batches of 4 x 16 tokens on this rank
        clock.on_train_batch_end(trainer, None, None, torch.zeros(4, 16), 0)
    clock.on_train_end(trainer, None)
    assert clock.dims == DP2_TP2  # read (and the sampler checked) when training started
    data = DataSpec(batch_size=4, seq_len=16, batch_chosen_at_run_time=False, node={})
    precision = SimpleNamespace(name="bf16", trainer_precision="bf16-mixed")
    metrics = _collect_metrics(data, trainer, torch.nn.Linear(2, 2), "m", clock, precision, {}, 12.0, None, {})
    assert metrics["world_size"] == 4
    assert metrics["data_parallel_size"] == 2
    assert metrics["parallel_dims"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert metrics["global_batch_size"] == 4 * 3 * 2
    assert metrics["tokens_this_run"] == 15 * 64 * 2
    assert metrics["tokens_seen"] == 5 * 24 * 16
    assert metrics["tokens_per_sec"] == 15 * 64 * 2 / 10.0


def test_the_planner_counts_replicas_not_ranks():
    inputs = PlanInputs(TINY, micro_batch=2, accumulate=3, seq_len=16, devices=2, num_nodes=2)
    assert (inputs.world_size, inputs.data_parallel_size) == (4, 4)
    row = estimate_dict(estimate_plan(inputs, device_memory_bytes=2**30, peak_flops=1e12, price_per_device_hour=None))
    assert (row["world_size"], row["data_parallel_size"]) == (4, 4)
    # TP 2 on the same 4 ranks: 2 replicas; DeepSpeed has no tensor parallelism, so its layout is refused.
    fsdp = StrategyLayout("fsdp", "fsdp")
    tp = PlanInputs(
        TINY, layout=fsdp, micro_batch=2, accumulate=3, seq_len=16, devices=2, num_nodes=2, tensor_parallel=2
    )
    assert (tp.world_size, tp.data_parallel_size) == (4, 2)
    tp_row = estimate_dict(estimate_plan(tp, device_memory_bytes=2**30, peak_flops=1e12, price_per_device_hour=None))
    assert (tp_row["world_size"], tp_row["data_parallel_size"]) == (4, 2)
    with pytest.raises(IncompatibleConfigError, match="not under DeepSpeed") as err:
        PlanInputs(TINY, layout=StrategyLayout("zero3", "deepspeed", 3), devices=4, tensor_parallel=2)
    assert "strategy.tensor_parallel_size" in err.value.keys


@pytest.mark.slow
def test_a_real_2x2_mesh_on_4_processes(tmp_path):
    """Lightning's ModelParallelStrategy (with our DimsSampling) on 4 gloo processes: dims, sampler ranks and the
    batches each rank read; then TrainOptDDPStrategy on the same processes shards as Lightning's DDPStrategy does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    worker = ROOT / "tests" / "unit" / "parallel" / "_dims_worker.py"
    done = subprocess.run([*cmd, str(worker), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, seen in enumerate(ranks):
        assert seen["rank"] == r
        assert seen["dims"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
        assert (seen["world_size"], seen["dp"], seen["dp_rank"]) == (4, 2, r // 2)
        assert seen["sampler"] == seen["lightning_sampler"] == {"num_replicas": 2, "rank": r // 2}
        ddp = seen["ddp"]
        assert ddp["dims"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 1}
        assert ddp["sampler"] == ddp["lightning_sampler"] == {"num_replicas": 4, "rank": r}
        t = seen["throughput"]
        assert t["tokens"] == 3 * 2 * 16
        assert t["tokens_per_s_total"] == pytest.approx(t["tokens"] * 2 / t["seconds"], rel=1e-9)
        assert t["tokens_per_s"] == pytest.approx(t["tokens"] / 2 / t["seconds"], rel=1e-9)
    assert ranks[0]["batches"] == ranks[1]["batches"]
    assert ranks[2]["batches"] == ranks[3]["batches"]
    assert ranks[0]["batches"] != ranks[2]["batches"]
    ddp_batches = [json.dumps(seen["ddp"]["batches"]) for seen in ranks]
    assert len(set(ddp_batches)) == 4  # under DDP every rank reads its own samples
