from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_trainopt.core.saved_tensors import (
    SavedTensorsCounter,
    measure_saved_tensors,
    transform_saved_tensors,
)


def test_counts_one_saved_tensor_exactly() -> None:
    x = torch.randn(64, 32, requires_grad=True)
    with SavedTensorsCounter() as counter:
        y = torch.sin(x)  # sin saves its input
    report = counter.report()
    # x is a leaf that requires grad: autograd saves it, and it is not a parameter (not an nn.Parameter, no _base).
    assert report.activation_bytes == 64 * 32 * 4
    assert report.n_saved == 1
    assert report.by_dtype == {"float32": 64 * 32 * 4}
    y.sum().backward()


def test_views_of_one_storage_count_once() -> None:
    a = torch.randn(128, 128, requires_grad=True)
    h = a * 2  # one 64 KiB storage
    with SavedTensorsCounter() as counter:
        out = torch.sin(h) + torch.cos(h.t()) + torch.exp(h[:64]).sum()
    report = counter.report()
    assert report.n_saved >= 3
    # sin(h), cos(h.t()) save views of h; exp saves its *output*, a new storage of 64x128.
    assert report.activation_bytes == 128 * 128 * 4 + 64 * 128 * 4
    out.sum().backward()


def test_parameters_are_reported_apart() -> None:
    lin = nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256, requires_grad=True)
    _, report = measure_saved_tensors(lin, x)
    assert report.parameter_bytes == 256 * 256 * 4  # the weight, saved for the input gradient
    assert report.activation_bytes == 8 * 256 * 4  # the input, saved for the weight gradient


def test_explicit_params_classify_plain_tensors() -> None:
    w = torch.randn(32, 32)  # not a Parameter, e.g. a gathered ZeRO-3 copy
    x = torch.randn(4, 32, requires_grad=True)
    with SavedTensorsCounter(params=[w]) as counter:
        (x @ w).sum()
    report = counter.report()
    assert report.parameter_bytes == 32 * 32 * 4
    assert report.activation_bytes == 0  # x @ w with w not requiring grad saves only w


def test_checkpointing_is_seen_as_what_it_keeps() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64))
    x = torch.randn(16, 64, requires_grad=True)
    _, plain = measure_saved_tensors(mlp, x)
    _, ckpt = measure_saved_tensors(lambda t: checkpoint(mlp, t, use_reentrant=False), x)
    assert ckpt.activation_bytes == 16 * 64 * 4  # only the region's input is kept
    assert plain.activation_bytes > 10 * ckpt.activation_bytes


class _HalfStore:
    """A transform that stores float tensors as bf16: the counter must see the bf16 bytes."""

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return t.to(torch.bfloat16), t.dtype

    def unpack(self, packed: tuple[torch.Tensor, torch.dtype]) -> torch.Tensor:
        return packed[0].to(packed[1])


@pytest.mark.parametrize("counter_first", [True, False])
def test_counter_sees_transform_output_in_any_order(counter_first: bool) -> None:
    x = torch.randn(64, 64, requires_grad=True)
    counter = SavedTensorsCounter()
    transform = _HalfStore()
    if counter_first:
        counter.start()
        ctx = transform_saved_tensors(transform)
        ctx.__enter__()
    else:
        ctx = transform_saved_tensors(transform)
        ctx.__enter__()
        counter.start()
    y = torch.sin(x)
    # Leave in the same order as entered (what Lightning does with callbacks): must not break either.
    if counter_first:
        counter.stop()
        ctx.__exit__(None, None, None)
    else:
        ctx.__exit__(None, None, None)
        counter.stop()
    report = counter.report()
    assert report.by_dtype == {"bfloat16": 64 * 64 * 2}
    y.sum().backward()
    expected = torch.cos(x.detach().to(torch.bfloat16).float())
    torch.testing.assert_close(x.grad, expected)
    # Nothing is left installed: a fresh tensor's saved values are stored untouched.
    z = torch.randn(4, requires_grad=True)
    torch.sin(z).sum().backward()
    torch.testing.assert_close(z.grad, torch.cos(z.detach()))


def test_two_transforms_refused() -> None:
    with transform_saved_tensors(_HalfStore()), pytest.raises(RuntimeError, match="already active"):  # noqa: SIM117
        with transform_saved_tensors(_HalfStore()):
            pass


def test_mark_and_peak_across_micro_batches() -> None:
    lin = nn.Linear(16, 16)
    counter = SavedTensorsCounter()
    with counter:
        lin(torch.randn(4, 16)).sum().backward()
        first = counter.mark()
        lin(torch.randn(8, 16)).sum().backward()
        second = counter.mark()
    assert (first, second) == (4 * 16 * 4, 8 * 16 * 4)
    assert counter.peak == second
    assert counter.report().activation_bytes == 0
    counter.reset()
    assert counter.peak == 0


def test_storage_freed_and_address_reused_counts_twice() -> None:
    counter = SavedTensorsCounter()
    with counter:
        for _ in range(5):
            a = torch.randn(256, 256, requires_grad=True)
            y = torch.sin(a)  # saves a; dropping y and a frees it, the next a may land at the same address
            del y, a
    report = counter.report()
    assert report.n_saved == 5
    assert report.activation_bytes == 5 * 256 * 256 * 4


def test_meta_tensors_pass_through_transform_and_counters_untouched() -> None:
    # SpeedMonitor counts FLOPs on a meta copy while ActivationCompression/Offload and MemoryBreakdown are active:
    # meta tensors have no data to transform (copying them out raises) and no bytes to count.
    from lightning_trainopt.techniques.compression import Int8Compressor

    w = torch.empty(32, 32, device="meta", requires_grad=True)
    real = torch.randn(8, 8, requires_grad=True)
    with SavedTensorsCounter() as counter, transform_saved_tensors(Int8Compressor(min_numel=1)):
        y = torch.sin(torch.empty(4, 32, device="meta") @ w)
        y.sum().backward()
        assert w.grad is not None
        assert w.grad.shape == (32, 32)
        torch.sin(real)  # a real tensor is still compressed and counted: 64 int8 codes + one fp32 block scale
    assert counter.report().by_dtype == {"int8": 8 * 8, "float32": 4}


def test_autocast_weight_copies_are_reported_apart_inside_activations() -> None:
    # Under autocast each Linear saves a bf16 copy of its weight for the input gradient: real bytes saved for
    # backward (activations), but fixed per step. The trained weight's copy is traced through autograd, the frozen
    # one's (no autograd history) is matched against the parameters given to the counter.
    torch.manual_seed(0)
    trained, frozen = nn.Linear(64, 32, bias=False), nn.Linear(32, 16, bias=False).requires_grad_(False)
    x = torch.randn(8, 64, requires_grad=True)
    params = [*trained.parameters(), *frozen.parameters()]
    with SavedTensorsCounter(params=params) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        y = frozen(trained(x))
    report = counter.report()
    copies = 64 * 32 * 2 + 32 * 16 * 2
    assert report.weight_copy_bytes == copies
    # Also saved: the input's own bf16 cast (x is a leaf, not a parameter), an ordinary activation; the frozen layer's
    # input is not saved (no weight gradient to compute).
    assert report.activation_bytes == copies + 8 * 64 * 2
    assert counter.mark() == report.activation_bytes
    assert (counter.peak, counter.peak_weight_copy_bytes, counter.n_marks) == (report.activation_bytes, copies, 1)
    y.float().sum().backward()
    assert trained.weight.grad is not None


def test_frozen_weight_copy_is_matched_by_value_not_by_shape() -> None:
    # A frozen fp32 base (LoRA-style) under bf16 autocast: the bf16 cast is a fresh tensor without grad_fn, saved
    # transposed (a view of the cast). Tensors that only share the weight's shape and dtype are activations.
    torch.manual_seed(0)
    base, head = nn.Linear(32, 16, bias=False).requires_grad_(False), nn.Linear(16, 4, bias=False)
    h = torch.randn(8, 32, requires_grad=True)
    a = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    lookalike = torch.randn(16, 32).to(torch.bfloat16)  # differs in the first row already
    near_copy = base.weight.detach().to(torch.bfloat16)
    near_copy[-1, -1] += 1  # equal to the copy except its last element
    with SavedTensorsCounter(params=[*base.parameters(), *head.parameters()]) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = head(base(h))
        z = a * lookalike + a * near_copy  # each product saves the other factor for a's gradient
    report = counter.report()
    assert report.weight_copy_bytes == 16 * 32 * 2 + 4 * 16 * 2  # base's copy (frozen) + head's copy (trained)
    # Also saved, as activations: base's bf16 output (for head's weight gradient) and the two lookalikes. The frozen
    # layer's input is not saved (no weight gradient to compute).
    assert report.activation_bytes == report.weight_copy_bytes + 8 * 16 * 2 + 2 * (16 * 32 * 2)
    assert report.parameter_bytes == 0
    (y.float().sum() + z.float().sum()).backward()
    assert head.weight.grad is not None


def test_a_storage_saved_by_every_layer_is_compared_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # An attention mask shaped like a weight, saved by every layer, costs one comparison, not one per save.
    from lightning_trainopt.core import saved_tensors

    calls: list[int] = []
    real = saved_tensors._is_cast_of

    def counting(t: torch.Tensor, p: torch.Tensor) -> bool:
        calls.append(1)
        return real(t, p)

    monkeypatch.setattr(saved_tensors, "_is_cast_of", counting)
    frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
    mask = torch.rand(8, 8).to(torch.bfloat16)
    h = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
    with SavedTensorsCounter(params=frozen.parameters()) as counter:
        for _ in range(4):
            h = h * mask
    assert counter.report().weight_copy_bytes == 0
    assert len(calls) == 1


def test_peft_lora_copies_of_frozen_base_weights_are_counted() -> None:
    peft = pytest.importorskip("peft")

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(32, 24), nn.Linear(24, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.b(torch.relu(self.a(x)))))

    torch.manual_seed(0)
    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=4, target_modules=["a", "b"]))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]  # bases, lora_A/B, head
    frozen = sum(m.weight.numel() for m in linears if not m.weight.requires_grad)
    trained = sum(m.weight.numel() for m in linears if m.weight.requires_grad)
    assert frozen == 24 * 32 + 16 * 24 + 4 * 16
    # Hidden states from earlier trained layers require grad, so every Linear saves its weight's bf16 copy.
    x = torch.randn(2, 5, 32, requires_grad=True)
    with SavedTensorsCounter(params=model.parameters()) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    report = counter.report()
    assert report.weight_copy_bytes == 2 * (frozen + trained)
    assert report.parameter_bytes == 0
    y.float().sum().backward()
