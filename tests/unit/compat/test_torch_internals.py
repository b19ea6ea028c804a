"""The private torch attributes ``_compat/torch_internals.py`` reads are still there, in the shape it expects."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lightning_trainopt._compat import torch_internals as ti
from tests.unit.compat._upstream import require, require_in_range


def _require(condition: bool, what: str) -> None:
    require(condition, "torch", what, ti.TORCH_RANGE, "torch_internals")


def test_installed_torch_is_in_the_range_written_for():
    require_in_range("torch", ti.TORCH_RANGE, "torch_internals")


def test_fake_tensor_mode_allocates_nothing():
    with ti.fake_tensor_mode():
        t = torch.empty(1 << 40, dtype=torch.uint8)  # a terabyte: only a fake tensor can be made
    assert t.shape == (1 << 40,)
    _require(type(t).__name__ == "FakeTensor", "torch._subclasses.fake_tensor.FakeTensorMode")


def test_replace_own_tensors_keeps_kinds_and_leaves_children():
    outer = nn.Sequential(nn.BatchNorm1d(3))
    bn = outer[0]
    ti.replace_own_tensors(bn, lambda t: nn.Parameter(t + 1) if isinstance(t, nn.Parameter) else t + 1)
    assert torch.equal(bn.weight, torch.full((3,), 2.0))
    assert isinstance(bn.weight, nn.Parameter)
    assert torch.equal(bn.running_mean, torch.ones(3))
    assert "running_mean" in dict(bn.named_buffers())
    ti.replace_own_tensors(outer, lambda t: t * 0)  # the container holds none of its own: nothing changes
    assert torch.equal(bn.weight, torch.full((3,), 2.0))


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(2)
    before = ti.tensor_version(t)
    t.add_(1)
    assert ti.tensor_version(t) == before + 1


def test_tensor_base_of_a_view():
    t = torch.zeros(4)
    assert ti.tensor_base(t[1:]) is t
    assert ti.tensor_base(t) is None


def test_fully_shard_still_records_the_original_class_index():
    from torch.distributed.fsdp._fully_shard import _fully_shard

    _require("_orig_cls_mro_index" in inspect.getsource(_fully_shard), "fully_shard's _orig_cls_mro_index")

    class Block(nn.Linear):
        pass

    swapped = type("FSDPBlock", (Block,), {"_orig_cls_mro_index": 1})
    assert ti.pre_fsdp_class(swapped) is Block
    assert ti.pre_fsdp_class(Block) is Block


def test_compiled_module_detection_without_compiling():
    plain, compiled_in_place = nn.Linear(2, 2), nn.Linear(2, 2)
    compiled_in_place.compile()  # compiles lazily, at the first call: nothing is compiled here
    _require(ti.has_compiled_call(compiled_in_place), "nn.Module._compiled_call_impl")
    assert not ti.has_compiled_call(plain)
    wrapped = torch.compile(plain)
    _require(ti.compiled_original(wrapped) is plain, "OptimizedModule._orig_mod")
    assert ti.compiled_original(plain) is plain


def test_foreach_norms_is_each_tensors_l2_norm_in_its_dtype():
    _require(callable(getattr(torch, "_foreach_norm", None)), "torch._foreach_norm")
    tensors = [torch.tensor([3.0, 4.0]), torch.ones(2, 2, dtype=torch.float64), torch.tensor([float("nan")])]
    norms = ti.foreach_norms(tensors)
    assert [n.shape for n in norms] == [torch.Size([])] * 3
    assert [n.dtype for n in norms] == [torch.float32, torch.float64, torch.float32]
    assert norms[0].item() == 5.0
    assert norms[1].item() == 2.0
    assert norms[2].isnan()
