from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import measure_saved_tensors
from lightning_trainopt.models import GPT, GPTConfig
from lightning_trainopt.transforms.checkpointing import (
    CheckpointPolicy,
    apply_activation_checkpointing,
    find_block_list,
    is_checkpointed,
    remove_activation_checkpointing,
    select_modules,
)

CFG = GPTConfig(vocab_size=64, n_layers=4, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=32)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _loss_and_grads(model: GPT, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = model.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_policy_validation() -> None:
    with pytest.raises(ConfigError, match="every_k"):
        CheckpointPolicy(every_k=0)
    with pytest.raises(ConfigError, match="either module_classes or names"):
        CheckpointPolicy(module_classes=("Block",), names=("blocks.0",))
    with pytest.raises(ConfigError, match="module_classes"):
        select_modules(_model(), CheckpointPolicy(module_classes=("NoSuchLayer",)))
    with pytest.raises(ConfigError, match="names"):
        select_modules(_model(), CheckpointPolicy(names=("nothing.*",)))
    with pytest.raises(ConfigError, match="no nn.ModuleList"):
        select_modules(nn.Linear(2, 2), CheckpointPolicy())


def test_selection_by_class_names_default_and_every_k() -> None:
    model = _model()
    assert find_block_list(model)[0] == "blocks"
    by_class, n = select_modules(model, CheckpointPolicy(module_classes=("Block",)))
    assert [name for name, _ in by_class] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert n == 4
    default, _ = select_modules(model, CheckpointPolicy())
    assert [name for name, _ in default] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    every2, n2 = select_modules(model, CheckpointPolicy(every_k=2))
    assert [name for name, _ in every2] == ["blocks.0", "blocks.2"]
    assert n2 == 4
    by_name, _ = select_modules(model, CheckpointPolicy(names=("blocks.1", "blocks.3.*")))
    # blocks.3.* matches submodules of block 3 only; the outermost of each are kept.
    names = [name for name, _ in by_name]
    assert names[0] == "blocks.1"
    assert all(n.startswith("blocks.3.") and n.count(".") == 2 for n in names[1:])
    # An ancestor and its descendants: only the ancestor is wrapped.
    nested, _ = select_modules(model, CheckpointPolicy(module_classes=("Block", "SwiGLU")))
    assert [name for name, _ in nested] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def test_same_gradients_less_saved_memory_and_reversible() -> None:
    x = torch.randint(0, 64, (4, 33))
    model = _model()
    ref_loss, ref_grads = _loss_and_grads(model, x)
    _, plain = measure_saved_tensors(model.loss, x[:, :-1], x[:, 1:])

    plan = apply_activation_checkpointing(model, CheckpointPolicy(module_classes=("Block",)))
    assert plan.wrapped == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert all(is_checkpointed(b) for b in model.blocks)
    # state_dict keys unchanged: checkpoints stay loadable without the technique.
    assert list(model.state_dict()) == list(_model().state_dict())
    loss, grads = _loss_and_grads(model, x)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    _, ckpt = measure_saved_tensors(model.loss, x[:, :-1], x[:, 1:])
    assert ckpt.activation_bytes < 0.4 * plain.activation_bytes

    # Idempotent, then fully reversible.
    apply_activation_checkpointing(model, CheckpointPolicy(module_classes=("Block",)))
    assert remove_activation_checkpointing(model) == 4
    assert not any(is_checkpointed(b) for b in model.blocks)
    assert "forward" not in model.blocks[0].__dict__
    _, again = measure_saved_tensors(model.loss, x[:, :-1], x[:, 1:])
    assert again.activation_bytes == plain.activation_bytes


def test_recomputed_fraction_counts_linear_params() -> None:
    model = _model()
    plan = apply_activation_checkpointing(model, CheckpointPolicy(every_k=2))
    block_linear = sum(p.numel() for m in model.blocks[0].modules() if isinstance(m, nn.Linear) for p in m.parameters())
    all_linear = 4 * block_linear + CFG.vocab_size * CFG.d_model  # tied lm_head counts once
    assert plan.recomputed_params == 2 * block_linear
    assert plan.recomputed_fraction == pytest.approx(2 * block_linear / all_linear)
    assert plan.flops_factor == pytest.approx(1 + plan.recomputed_fraction / 3)
    assert model.blocks[0].__dict__.get("_trainopt_checkpointed") is True
    assert "_trainopt_checkpointed" not in model.blocks[1].__dict__


def test_no_checkpoint_without_grad() -> None:
    model = _model()
    apply_activation_checkpointing(model, CheckpointPolicy())
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 8, 64)


class Conv1D(nn.Module):
    """Hugging Face GPT-2's projection: a plain parameter and addmm, not an nn.Linear."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class ConvBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc = Conv1D(d, 4 * d)
        self.proj = Conv1D(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.proj(torch.relu(self.fc(x)))


class Foreign(nn.Module):
    def __init__(self, d: int = 16, n: int = 4, vocab: int = 50, shared: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(32, d)
        self.blocks = nn.ModuleList([ConvBlock(d)] * n if shared else [ConvBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _block_matmul(d: int) -> int:
    # MultiheadAttention in_proj (3d x d) + out_proj (d x d), two Conv1D (d x 4d, 4d x d).
    return 3 * d * d + d * d + 2 * 4 * d * d


def test_recomputed_fraction_counts_every_matmul_weight_of_a_foreign_model() -> None:
    # Only nn.Linear used to count: Conv1D and MultiheadAttention.in_proj_weight were missed (fraction 0 on GPT-2).
    model = Foreign()
    plan = apply_activation_checkpointing(model, CheckpointPolicy())
    assert plan.wrapped == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert plan.recomputed_params == 4 * _block_matmul(16)
    assert plan.linear_params == 4 * _block_matmul(16) + 50 * 16  # tied head once, embeddings are lookups
    every2 = apply_activation_checkpointing(Foreign(), CheckpointPolicy(every_k=2))
    assert every2.recomputed_fraction == pytest.approx(plan.recomputed_fraction / 2)
    assert 0.9 < plan.recomputed_fraction < 1.0


def test_shared_block_plans_are_per_call_and_refuse_every_k() -> None:
    # ModuleList([layer] * 4): one object called four times. Fractions came out at 3.9; every_k=2 "wrapped half"
    # but checkpointed every call; module_classes saw 1 candidate of 1.
    d = 16
    default = apply_activation_checkpointing(Foreign(shared=True), CheckpointPolicy())
    by_class = apply_activation_checkpointing(Foreign(shared=True), CheckpointPolicy(module_classes=("ConvBlock",)))
    for plan in (default, by_class):
        assert plan.n_candidates == 4
        assert plan.recomputed_params == 4 * _block_matmul(d)
        assert plan.linear_params == 4 * _block_matmul(d) + 50 * d
        assert 0.0 < plan.recomputed_fraction < 1.0
        assert plan.flops_factor < 4 / 3
    with pytest.raises(ConfigError, match=r"every_k=2 is invalid.*shared") as err:
        apply_activation_checkpointing(Foreign(shared=True), CheckpointPolicy(every_k=2))
    assert "activation_checkpointing.every_k" in str(err.value)
    model = Foreign(shared=True)
    apply_activation_checkpointing(model, CheckpointPolicy())
    assert is_checkpointed(model.blocks[0])
    assert remove_activation_checkpointing(model) == 1


@pytest.mark.parametrize(
    ("policy", "typo"),
    [
        (CheckpointPolicy(module_classes=("ConvBlock", "TypoLayer")), "TypoLayer"),
        (CheckpointPolicy(names=("blocks.*", "typo.*")), "typo.*"),
    ],
)
def test_each_unmatched_class_or_pattern_is_refused(policy: CheckpointPolicy, typo: str) -> None:
    with pytest.raises(ConfigError, match=rf"\['{typo}'\] matched nothing") as err:
        select_modules(Foreign(), policy)
    assert "activations.activation_checkpointing." in str(err.value)


def test_a_self_checkpointing_model_is_left_alone() -> None:
    model = Foreign()
    model.gradient_checkpointing = True  # what Hugging Face's gradient_checkpointing_enable() sets
    plan = apply_activation_checkpointing(model, CheckpointPolicy())
    assert plan.self_checkpointed == ("<root>",)
    assert plan.wrapped == ()
    assert not any(is_checkpointed(b) for b in model.blocks)
    assert plan.recomputed_params == 4 * _block_matmul(16)  # its own checkpointing still recomputes, for HFU
