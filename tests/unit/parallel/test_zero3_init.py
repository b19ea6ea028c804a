"""ZeRO-3 re-runs the model's own init after ``deepspeed.zero.Init``, one module (at most one block) gathered at a time.

``deepspeed.zero.Init`` partitions each parameter as its module is built, so an init that runs at the end of the
model's ``__init__`` (GPT's N(0, 0.02), a Hugging Face model's ``post_init``) writes into empty placeholders. The
strategy re-runs it; these tests build on one gloo process and read the gathered weights.
"""

from __future__ import annotations

import math
import os
import socket
from contextlib import contextmanager

import pytest
import torch

from tests.helpers.hf import hf_model
from tests.helpers.runif import RunIf

pytestmark = RunIf(deepspeed=True)

ZERO3 = {"zero_optimization": {"stage": 3}, "train_batch_size": 1}


def _one_process_group() -> None:
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


@contextmanager
def _recorded_gathers(sizes: list[int]):
    """Record the elements of every ``GatheredParameters`` the re-init opens."""
    import deepspeed

    real = deepspeed.zero.GatheredParameters

    def recording(params, *args, **kwargs):
        sizes.append(sum(int(getattr(p, "ds_numel", p.numel())) for p in params))
        return real(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = recording
    try:
        yield
    finally:
        deepspeed.zero.GatheredParameters = real


def _build_under_zero3(build) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``build()`` inside ``zero.Init``, re-initialised as the strategy does; its gathered weights and gather sizes."""
    import deepspeed

    from lightning_trainopt.parallel.deepspeed import _rerun_custom_init

    _one_process_group()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        root = torch.nn.ModuleDict({"model": build()})  # the LightningModule's place: the model is a child
    sizes: list[int] = []
    with _recorded_gathers(sizes):
        _rerun_custom_init(root, existing=set())
    params = list(root.parameters())
    with deepspeed.zero.GatheredParameters(params):
        weights = {k.removeprefix("model."): v.detach().clone() for k, v in root.named_parameters()}
    return weights, sizes


def _gpt():
    from lightning_trainopt.models import GPT, GPTConfig

    return GPT(GPTConfig(n_layers=3, d_model=64, n_heads=4, ffn_hidden=172, vocab_size=256, tie_embeddings=True))


def _largest_block(model: torch.nn.Module, block: str) -> int:
    return max(sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ == block)


def test_gpt_under_zero3_gets_exactly_the_weights_of_a_plain_build():
    torch.manual_seed(0)
    reference = _gpt()
    torch.manual_seed(0)
    weights, sizes = _build_under_zero3(_gpt)
    for name, p in reference.named_parameters():
        assert torch.equal(weights[name], p.detach()), name
    # No gather holds more than one block or the embedding; the whole model never.
    total = sum(p.numel() for p in reference.parameters())
    assert max(sizes) == max(_largest_block(reference, "Block"), reference.embed.weight.numel())
    assert max(sizes) < total / 2


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_init_is_rerun_under_zero3(kind):
    """Without the re-run the shards keep torch's defaults: N(0, 1) embeddings, Kaiming-uniform linears."""
    torch.manual_seed(0)
    reference = hf_model(kind, n_layers=4)
    torch.manual_seed(0)
    weights, sizes = _build_under_zero3(lambda: hf_model(kind, n_layers=4))
    std = reference.config.initializer_range
    embed = "model.embed_tokens.weight" if kind == "llama" else "transformer.wte.weight"
    assert float(weights[embed].std()) == pytest.approx(std, rel=0.1)  # torch's default would be 1.0
    matrices = [k for k, v in weights.items() if v.dim() >= 2 and "proj" not in k]
    for name in matrices:
        assert float(weights[name].std()) == pytest.approx(std, rel=0.25), name
    if kind == "gpt2":
        # GPT-2's _init_weights(GPT2Attention) rescales its child c_proj: the child must be gathered with it.
        residual = std / math.sqrt(2 * reference.config.n_layer)
        c_proj = torch.cat([weights[f"transformer.h.{i}.attn.c_proj.weight"].flatten() for i in range(4)])
        assert float(c_proj.std()) == pytest.approx(residual, rel=0.1)
        # Norms are ones again, biases zero.
        assert torch.equal(weights["transformer.h.0.ln_1.weight"], torch.ones(32))
        assert not weights["transformer.h.0.attn.c_attn.bias"].any()
        assert "lm_head.weight" not in weights  # still tied to wte (named_parameters lists a shared tensor once)
    block = "LlamaDecoderLayer" if kind == "llama" else "GPT2Block"
    total = sum(p.numel() for p in reference.parameters())
    assert max(sizes) <= max(_largest_block(reference, block), weights[embed].numel())
    assert max(sizes) < total / 2
