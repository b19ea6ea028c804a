"""``meta_copy``: what the FLOP counter runs on, whatever a strategy did to the module (hooks, shards, class swaps)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from lightning_trainopt.metrics.flops import count_flops, fit_seq_flops, meta_copy
from lightning_trainopt.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=16)


def test_the_copy_runs_none_of_the_hooks_and_the_original_keeps_them():
    # A sharding engine's hooks (ZeRO-3's parameter fetch, FSDP2's all-gather) must never run on the copy: they
    # changed the engine's state and broke the real step afterwards.
    calls: list[str] = []
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].register_forward_pre_hook(lambda m, args: calls.append("pre"))
    model[1].register_forward_hook(lambda m, args, out: calls.append("post"))
    model[1].register_full_backward_hook(lambda m, gin, gout: calls.append("backward"))
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append("kwargs"), with_kwargs=True)
    assert count_flops(model, torch.randn(3, 4)) == 2 * 3 * (4 * 8 + 8 * 2) + 2 * 2 * 3 * 8 * 2 + 2 * 3 * 4 * 8
    assert calls == []
    model(torch.randn(3, 4)).sum().backward()
    assert calls == ["kwargs", "pre", "post", "backward"]


def test_placeholders_of_zero3_take_their_full_shape():
    # DeepSpeed ZeRO-3 leaves an empty tensor in each partitioned parameter and keeps the real shape in ds_shape.
    model = GPT(CFG)
    whole = count_flops(model, torch.zeros(2, 16, dtype=torch.long))
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    copy = meta_copy(model)
    assert [tuple(p.shape) for p in copy.parameters()] == [tuple(p.ds_shape) for p in model.parameters()]
    assert count_flops(model, torch.zeros(2, 16, dtype=torch.long)) == whole


def test_tied_weights_and_shared_modules_stay_shared():
    model = GPT(CFG)
    assert model.lm_head.weight is model.embed.weight
    copy = meta_copy(model)
    assert copy.lm_head.weight is copy.embed.weight
    shared = nn.Linear(4, 4)
    root = nn.ModuleList([shared, shared])
    c = meta_copy(root)
    assert c[0] is c[1]


def test_attributes_that_refuse_copying_are_shared():
    model = nn.Linear(4, 4)
    model.lock = threading.Lock()  # deepcopy raises "cannot pickle '_thread.lock' object"
    model.table = {"scale": [1, 2]}
    copy = meta_copy(model)
    assert copy.lock is model.lock
    assert copy.table == model.table
    assert copy.table is not model.table


def test_an_fsdp2_sharded_model_is_counted_as_the_whole_model(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    batch = torch.zeros(2, 8, dtype=torch.long)
    whole = fit_seq_flops(GPT(CFG), batch, samples=2, seq_len=8)
    # A file store: no network port, so tests running side by side cannot collide.
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    copy = meta_copy(model)
    assert not any(isinstance(m, FSDPModule) for m in copy.modules())  # FSDP2 refuses deepcopy: classes restored
    assert all(isinstance(m, FSDPModule) for m in (model, *model.blocks))  # the original is untouched
    sharded = fit_seq_flops(model, batch, samples=2, seq_len=8)
    assert (sharded.per_token, sharded.per_token_squared) == (whole.per_token, whole.per_token_squared)


def test_a_qlora_model_is_counted_as_its_lora_twin():
    # A Hugging Face model under adapter=qlora left SpeedMonitor without FLOPs ("Tensor.item() cannot be called on
    # meta tensors", then "quant_state is required"): bitsandbytes' 4-bit layers cannot run on the meta device.
    import pytest

    pytest.importorskip("bitsandbytes")
    import transformers

    from lightning_trainopt.transforms.adapters import AdapterSpec, apply_adapter
    from tests.helpers.hf_files import _config

    counts = []
    for kind in ("lora", "qlora"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config("llama", 64))
        apply_adapter(model, AdapterSpec(kind=kind))
        counts.append(count_flops(model, torch.zeros(2, 16, dtype=torch.long)))
    assert counts[0] > 0
    assert counts[1] == counts[0]
