import pytest
import torch

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.parallel import TrainOptFSDPStrategy, apply_fully_shard
from lightning_trainopt.parallel.report import StrategyReport, strategy_offload


def test_report_rejects_bad_step_and_reports_nothing_before_measuring():
    with pytest.raises(ConfigError, match="at_step"):
        StrategyReport(at_step=-1)
    assert StrategyReport().summary() == {"memory_breakdown": None}


def test_strategy_offload_reads_the_strategy():
    assert strategy_offload(TrainOptFSDPStrategy(cpu_offload=True)) == {"params": "cpu", "optimizer_states": "cpu"}
    assert strategy_offload(object()) == {"params": "none", "optimizer_states": "none"}


def test_strategy_offload_reads_a_foreign_deepspeed_config():
    class Foreign:  # e.g. Lightning's DeepSpeedStrategy built by a user: only its config dict says it
        config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": None}}

    assert strategy_offload(Foreign()) == {"params": "none", "optimizer_states": "nvme"}


def test_fsdp_shard_modules_must_be_class_names():
    with pytest.raises(ConfigError, match="shard_modules"):
        TrainOptFSDPStrategy(shard_modules="Block")


def test_apply_fully_shard_policy_on_a_single_process_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    # A file store: no network port, so tests running side by side cannot collide.
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    root = torch.nn.Module()
    root.model = GPT(GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=16))
    n = apply_fully_shard(root, ["Block"], mesh, cpu_offload=False, reshard_after_forward=True)
    assert n == 3  # two blocks, then the GPT itself
    assert all(hasattr(p, "to_local") for p in root.parameters())
