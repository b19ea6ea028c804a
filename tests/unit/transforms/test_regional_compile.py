"""Regional compilation: every block compiled in place, names and outputs unchanged, and FP8 blocks compile too."""

import pytest
import torch
from torch import nn

from lightning_trainopt._compat.torch_internals import is_compiled
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.transforms import compile_blocks
from tests.helpers.runif import RunIf

TINY = GPTConfig(n_layers=3, d_model=64, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=32)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)


def test_each_block_is_compiled_in_place_and_nothing_else():
    model = _gpt()
    keys = list(model.state_dict())
    x = torch.randint(0, 256, (2, 16))
    expected = model(x)
    # The eager backend: Dynamo traces each block (the wiring under test) without Inductor's minutes of codegen.
    assert compile_blocks(model, backend="eager") == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(is_compiled(block) for block in model.blocks)
    assert not is_compiled(model.lm_head)
    assert not is_compiled(model.embed)
    assert list(model.state_dict()) == keys  # no _orig_mod: checkpoints are interchangeable
    torch.testing.assert_close(model(x), expected)
    assert compile_blocks(model, backend="eager") == []  # idempotent


def test_named_classes_and_missing_blocks():
    model = _gpt()
    assert compile_blocks(model, ["SwiGLU"], backend="eager") == [f"blocks.{i}.mlp" for i in range(3)]
    with pytest.raises(ConfigError, match="no module"):
        compile_blocks(_gpt(), ["LlamaDecoderLayer"])
    with pytest.raises(ConfigError, match="no repeated block"):
        compile_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


@RunIf(torchao=True)
def test_fp8_blocks_compile_and_match_eager():
    from lightning_trainopt.precision import FP8PrecisionSpec, convert_model

    root = nn.Module()
    root.model = _gpt()
    convert_model(root, FP8PrecisionSpec("fp8", "bf16-mixed", skip_small=False), emulate=True, fsdp=False)
    x = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = root.model.loss(x[:, :-1], x[:, 1:])
        compile_blocks(root.model, backend="eager")
        got = root.model.loss(x[:, :-1], x[:, 1:])
    got.backward()
    torch.testing.assert_close(got, expected)
    assert root.model.blocks[0].attn.q_proj.weight.grad is not None
