import pytest
import torch

from lightning_trainopt.metrics.memory_accounting import (
    MemoryBreakdown,
    memory_breakdown,
    tensor_leaves,
    textbook_bytes_per_param,
)
from lightning_trainopt.models import GPT, GPTConfig
from tests.helpers.runif import RunIf

CFG = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=16)


def _trained(opt_cls=torch.optim.AdamW):
    model = GPT(CFG)
    opt = opt_cls(model.parameters(), lr=1e-3)
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    model.loss(x, x).backward()
    opt.step()
    return model, opt


def test_fp32_adam_matches_textbook_and_counts_tied_weights_once():
    model, opt = _trained()
    n = CFG.n_params()  # tied embedding counted once
    mb = memory_breakdown(model, [opt], compute_device="cpu")
    book = textbook_bytes_per_param(mixed_precision=False)
    assert mb.params.device == book["params"] * n
    assert mb.grads.device == book["grads"] * n
    # two fp32 moments per parameter plus one scalar step counter per parameter tensor
    n_tensors = len(list(model.parameters()))
    assert mb.optimizer_states.device == book["optimizer_states"] * n + 4 * n_tensors
    assert mb.params.cpu == mb.grads.cpu == mb.optimizer_states.cpu == 0


def test_offload_hint_moves_categories_to_cpu_on_a_cpu_run():
    model, opt = _trained()
    mb = memory_breakdown(model, [opt], compute_device="cpu", offload={"optimizer_states": "cpu"})
    assert mb.optimizer_states.device == 0
    assert mb.optimizer_states.cpu > 0
    assert mb.grads.device == 0
    assert mb.grads.cpu > 0
    assert mb.params.cpu == 0
    assert mb.params.device == 4 * CFG.n_params()


def test_tensors_off_the_compute_device_count_as_cpu():
    model, opt = _trained()
    mb = memory_breakdown(model, [opt], compute_device="cuda")
    assert mb.params.device == 0
    assert mb.params.cpu == 4 * CFG.n_params()


def test_meta_and_gradless_models():
    with torch.device("meta"):
        meta = GPT(CFG)
    assert memory_breakdown(meta, [], compute_device="cpu").total == 0
    model = GPT(CFG)
    mb = memory_breakdown(model, [], compute_device="cpu")
    assert mb.grads.total == 0
    assert mb.optimizer_states.total == 0


def test_nvme_folder_bytes(tmp_path):
    (tmp_path / "a.swp").write_bytes(b"x" * 1000)
    model = GPT(CFG)
    mb = memory_breakdown(model, [], compute_device="cpu", nvme_folders={"optimizer_states": str(tmp_path)})
    assert mb.optimizer_states.nvme == 1000


def test_to_dict_shape():
    d = MemoryBreakdown().to_dict()
    assert set(d) == {"params", "grads", "optimizer_states"}
    assert all(set(v) == {"device", "cpu", "nvme"} for v in d.values())


@pytest.mark.parametrize(("mixed", "total"), [(True, 16), (False, 16)])
def test_textbook_totals(mixed, total):
    assert sum(textbook_bytes_per_param(mixed).values()) == total


@RunIf(torchao=True)
def test_torchao_low_bit_states_are_counted_through_their_inner_tensors():
    # torchao keeps exp_avg / exp_avg_sq as tensor subclasses without a storage of their own: reading one's
    # data_ptr raised "invalid python storage" and crashed every torchao run at its first optimizer step.
    from lightning_trainopt.optim.optimizers import torchao_optimizer

    layer = torch.nn.Linear(256, 256, bias=False)
    opt = torchao_optimizer(layer.parameters(), name="AdamW8bit", lr=1e-3, block_size=256)
    layer(torch.randn(2, 256)).sum().backward()
    opt.step()
    state = opt.state[layer.weight]
    assert type(state["exp_avg"]) is not torch.Tensor
    leaves = list(tensor_leaves(state["exp_avg"]))
    assert {leaf.dtype for leaf in leaves} >= {torch.uint8, torch.float32}
    assert all(type(leaf) is torch.Tensor for leaf in leaves)
    mb = memory_breakdown(layer, [opt], compute_device="cpu")
    n = layer.weight.numel()
    # Two 8-bit moments: 1 byte per element each plus block scales and the shared 256-entry code map.
    assert 2 * n <= mb.optimizer_states.device < 2.2 * n
    assert mb.params.device == mb.grads.device == 4 * n
