import pytest
import torch
from torch import nn

from lightning_trainopt.metrics.flops import call_conventions, count_flops, fit_seq_flops, meta_copy, transformer_flops
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT


@pytest.mark.parametrize(
    ("cfg", "seq_len"),
    [
        (GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=172, max_seq_len=64), 64),
        (GPTConfig(n_layers=3, d_model=128, n_heads=8, n_kv_heads=2, ffn_hidden=344, tie_embeddings=False), 128),
    ],
)
def test_analytic_agrees_with_flop_counter(cfg, seq_len):
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(2, seq_len, dtype=torch.long)
    counted = count_flops(model, idx)
    analytic = transformer_flops(cfg, seq_len, batch_size=2)
    assert counted == pytest.approx(analytic.train, rel=0.03)
    assert count_flops(model, idx, backward=False) == pytest.approx(analytic.forward, rel=0.03)


def test_formula_by_hand():
    cfg = GPTConfig(vocab_size=100, n_layers=1, d_model=8, n_heads=2, ffn_hidden=16)
    f = transformer_flops(cfg, seq_len=4, batch_size=1)
    matmul_params = 4 * 8 * 8 + 3 * 8 * 16
    attention = 4 * 2 * 4 * 4 * 4  # 4 * heads * T * T * head_dim
    assert f.forward == 2 * matmul_params * 4 + attention + 2 * 8 * 100 * 4
    assert f.attention_forward == attention
    assert f.train == 3 * f.forward
    # Checkpointing replays each block but its FFN down-projection (torch's early stop): 2 * F * d per token.
    assert f.block_recompute == f.block_forward - 2 * 16 * 8 * 4
    assert f.hardware_train(1.0) == f.train + f.block_recompute
    assert f.hardware_train(0.5) == f.train + round(f.block_recompute / 2)


@pytest.mark.parametrize("every_k", [1, 2])
@pytest.mark.parametrize(
    "cfg",
    [
        GPTConfig(vocab_size=256, n_layers=4, d_model=64, n_heads=4, ffn_hidden=160, max_seq_len=128),
        GPTConfig(
            vocab_size=512, n_layers=3, d_model=128, n_heads=8, n_kv_heads=2, ffn_hidden=344, tie_embeddings=False
        ),
    ],
)
def test_analytic_recompute_equals_what_the_counter_sees_torch_replay(cfg, every_k):
    # The analytic HFU (our model) must agree with the FLOPs torch really replays under our ActivationCheckpointing.
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing

    with torch.device("meta"):
        model = GPT(cfg)
    apply_activation_checkpointing(model, CheckpointPolicy(every_k=every_k))
    fit = fit_seq_flops(model, torch.zeros(2, 64, dtype=torch.long), samples=2, seq_len=64)
    f = transformer_flops(cfg, 64, 2)
    share = len(range(0, cfg.n_layers, every_k)) / cfg.n_layers
    assert fit.hardware(2, 64) - fit(2, 64) == f.hardware_train(share) - f.train


def test_meta_copy_allocates_nothing_and_keeps_the_original():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    copy = meta_copy(model)
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert all(b.device.type == "meta" for b in copy.buffers())
    assert all(p.device.type == "cpu" for p in model.parameters())
    # forward 2*B*in*out; backward only the weight gradient (the input needs no grad)
    assert count_flops(model, torch.randn(3, 4)) == 2 * (2 * 3 * 4 * 4)


# --- one count, fitted to B * (c + a*T + b*T^2), then evaluated for any (B, T) ------------------------------------


class Encoder(nn.Module):
    """A foreign transformer: embedding, ``nn.TransformerEncoder`` with a padding mask, mean-pooled classifier head
    (the head is the per-sequence term ``c``)."""

    def __init__(self, vocab: int = 50, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        pad = None if attention_mask is None else attention_mask == 0
        logits = self.head(self.enc(self.emb(input_ids), src_key_padding_mask=pad).mean(1))
        if labels is not None:  # Hugging Face style: labels make the model compute its own loss
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
        return {"logits": logits}


def _dict_batch(b: int, t: int) -> dict:
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, t // 2 :] = 0
    return {"input_ids": torch.zeros(b, t, dtype=torch.long), "attention_mask": mask, "labels": torch.zeros(b).long()}


def test_fit_agrees_with_direct_counts_on_our_gpt():
    cfg = GPTConfig(vocab_size=96, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=172, max_seq_len=64)
    with torch.device("meta"):
        model = GPT(cfg)
    fit = fit_seq_flops(model, torch.zeros(2, 40, dtype=torch.long), samples=2, seq_len=40)
    assert fit.lengths == (40, 20, 10, 30)
    assert fit.call == "forward(batch)"
    assert fit.per_token_squared > 0  # attention
    for b, t in ((2, 7), (3, 33), (1, 64), (5, 40)):
        direct = count_flops(model, torch.zeros(b, t, dtype=torch.long))
        assert fit(b, t) == pytest.approx(direct, rel=0.01)
        assert fit(b, t) == direct  # the polynomial is exact for a transformer
    # And our analytic formula (what SpeedMonitor uses for LitGPT) agrees with it.
    assert fit(3, 33) == pytest.approx(transformer_flops(cfg, 33, 3).train, rel=0.03)


def test_fit_agrees_with_direct_counts_on_a_transformer_encoder_with_dict_batches():
    model = Encoder()
    fit = fit_seq_flops(model, _dict_batch(4, 24), samples=4, seq_len=24)
    assert fit.call == "forward(input_ids=, attention_mask=)"  # labels are never passed
    assert fit.per_sequence > 0  # the pooled head
    for b, t in ((4, 5), (2, 13), (4, 31), (6, 80)):
        direct = count_flops(model, {k: v for k, v in _dict_batch(b, t).items() if k != "labels"})
        assert fit(b, t) == pytest.approx(direct, rel=0.01)
        assert fit(b, t) == direct


def test_fit_by_hand_on_a_linear_model():
    # forward 2*B*T*4*8, backward: weight gradient only (the input needs none) -> 4*B*T*32 per (B, T).
    fit = fit_seq_flops(nn.Linear(4, 8, bias=False), torch.zeros(3, 10, 4), samples=3, seq_len=10)
    assert (fit.per_sequence, fit.per_token, fit.per_token_squared) == (0, 4 * 32, 0)
    assert fit(5, 7) == 4 * 32 * 5 * 7
    assert fit.to_dict() == {
        "per_sequence": 0.0,
        "per_token": 128.0,
        "per_token_squared": 0.0,
        "recomputed": [0.0, 0.0, 0.0],
        "recompute_share": 0.0,
        "lengths": [10, 5, 3, 8],
        "call": "forward(batch)",
    }
    assert fit.hardware(5, 7) == fit(5, 7)  # nothing checkpointed, nothing recomputed


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _SelfCheckpointing(nn.Module):
    """Three blocks; the ones in ``checkpointed`` call torch.utils.checkpoint themselves (no wrapper to detect)."""

    def __init__(self, checkpointed=(), reentrant=False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16, bias=False)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.checkpointed, self.reentrant = set(checkpointed), reentrant

    def forward(self, x):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            use = i in self.checkpointed and torch.is_grad_enabled()
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant) if use else block(x)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_forward_is_measured_apart_from_model_flops(reentrant):
    # Per token: embed 2*4*16, each block 2*16*16 forward. Backward: the embed's weight gradient only (its input
    # needs none), each block weight + input gradients. Checkpointing blocks 0 and 2 replays their forward once.
    plain = fit_seq_flops(_SelfCheckpointing(), torch.zeros(2, 6, 4), samples=2, seq_len=6)
    ckpt = fit_seq_flops(
        _SelfCheckpointing(checkpointed=(0, 2), reentrant=reentrant), torch.zeros(2, 6, 4), samples=2, seq_len=6
    )
    forward, block = 2 * 4 * 16 + 3 * 2 * 16 * 16, 2 * 16 * 16
    model = forward + 2 * 4 * 16 + 3 * 2 * (2 * 16 * 16)
    assert (plain.per_token, ckpt.per_token) == (model, model)  # model FLOPs do not change with checkpointing
    assert plain.recomputed == (0, 0, 0)
    assert plain.recompute_share == 0
    assert ckpt.recomputed == (0, 2 * block, 0)
    assert ckpt.recompute_share == pytest.approx(2 * block / forward)
    assert ckpt.hardware(3, 9) == 3 * 9 * (model + 2 * block)
    assert ckpt(3, 9) == plain(3, 9) == 3 * 9 * model
    # count_flops reports everything executed, recomputation included.
    assert count_flops(_SelfCheckpointing(checkpointed=(0, 2)), torch.zeros(3, 9, 4)) == ckpt.hardware(3, 9)


def test_fit_without_a_sequence_dimension_scales_with_samples():
    fit = fit_seq_flops(nn.Linear(6, 2), torch.zeros(4, 6), samples=4, seq_len=None)
    assert fit.lengths == ()
    assert fit.applies_to(None)
    assert not fit.applies_to(12)
    assert fit(10, None) == 10 * (2 * 6 * 2 + 2 * 6 * 2)  # per sample: forward 2*6*2, weight gradient 2*6*2


def test_call_conventions():
    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, batch):  # takes the whole dict
            return self.lin(batch["x"].float())

    class KwargsOnly(nn.Module):
        def forward(self, **inputs):
            return inputs

    batch = {"input_ids": 1, "attention_mask": 2, "labels": 3, "x": 4}
    assert [c.describe for c in call_conventions(Encoder(), batch)] == [
        "forward(input_ids=, attention_mask=)",
        "forward(batch)",
    ]
    assert [c.describe for c in call_conventions(Whole(), batch)] == ["forward(batch)"]
    kw = call_conventions(KwargsOnly(), batch)[0]
    assert kw.split(batch) == ((), {"input_ids": 1, "attention_mask": 2, "x": 4})  # every key but the labels
    tup = call_conventions(nn.Linear(2, 2), ("x", "y"))
    assert [c.describe for c in tup] == ["forward(batch[0])", "forward(*batch)", "forward(batch)"]
    assert tup[0].split(("x", "y")) == (("x",), {})
    # The whole-dict module is counted through its fallback convention.
    fit = fit_seq_flops(Whole(), {"x": torch.zeros(2, 5, 4), "labels": torch.zeros(2)}, samples=2, seq_len=5)
    assert fit.call == "forward(batch)"
    assert fit(2, 5) == 2 * (2 * 2 * 5 * 4 * 4)


def test_fit_fails_loudly_when_the_forward_reads_values():
    class Trim(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask):
            return self.lin(x[:, : int(mask.sum(1).max())])  # data-dependent: meta tensors have no values

    with pytest.raises(RuntimeError, match=r"forward\(batch\[0\]\).*forward\(\*batch\).*meta") as info:
        fit_seq_flops(Trim(), (torch.zeros(2, 6, 4), torch.ones(2, 6)), samples=2, seq_len=6)
    assert "forward(batch)" in str(info.value)


def test_fit_refuses_flops_that_are_not_polynomial_in_length():
    class Window(nn.Module):  # only the first 8 positions are used: FLOPs stop growing at T = 8
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return self.lin(x[:, :8])

    with pytest.raises(RuntimeError, match=r"do not follow B\*\(c \+ a\*T \+ b\*T\^2\)"):
        fit_seq_flops(Window(), torch.zeros(2, 16, 4), samples=2, seq_len=16)
