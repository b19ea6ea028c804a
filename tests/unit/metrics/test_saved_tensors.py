from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_trainopt.metrics.saved_tensors import (
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
    from lightning_trainopt.transforms.compression import Int8Compressor

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
    # A mask shaped like a frozen weight (and, worse, equal to its bf16 cast in every sampled element), saved by every
    # layer, costs one sampled read and one comparison, not one per save.
    from lightning_trainopt.metrics import frozen_weights

    frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
    mask = frozen.weight.detach().to(torch.bfloat16)
    mask[3, 3] += 1  # flat index 27: not among the sampled elements of an 8x8 tensor
    h = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
    counter = SavedTensorsCounter(params=frozen.parameters())
    calls: list[str] = []
    real_cast_of, real_fingerprint = frozen_weights._is_cast_of, frozen_weights._fingerprint

    def counting_cast_of(t: torch.Tensor, p: torch.Tensor) -> bool:
        calls.append("compare")
        return real_cast_of(t, p)

    def counting_fingerprint(t: torch.Tensor) -> bytes:
        calls.append("read")
        return real_fingerprint(t)

    monkeypatch.setattr(frozen_weights, "_is_cast_of", counting_cast_of)
    monkeypatch.setattr(frozen_weights, "_fingerprint", counting_fingerprint)
    with counter:
        for _ in range(4):
            h = h * mask
    assert counter.report().weight_copy_bytes == 0
    assert calls == ["read", "compare"]


def test_zero_input_shaped_like_a_zero_trainable_weight_is_an_activation() -> None:
    # LoRA's B is zero-initialised and trainable: its casts are traced through autograd, so it is no candidate for
    # value matching. An all-padding input of B's shape is an activation, not a weight copy.
    lora_b = nn.Linear(4, 16, bias=False)
    nn.init.zeros_(lora_b.weight)
    first = nn.Linear(4, 8, bias=False)
    x = torch.zeros(16, 4)
    params = [*lora_b.parameters(), *first.parameters()]
    with SavedTensorsCounter(params=params) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        first(x)  # saves x's bf16 cast for the weight gradient; x needs no gradient, so not the weight's copy
    report = counter.report()
    assert report.activation_bytes == 16 * 4 * 2
    assert report.weight_copy_bytes == 0


def test_many_same_shaped_frozen_weights_cost_one_comparison_per_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # 24 frozen weights of one shape: each saved copy finds its own weight by a sampled read, not by trying them all.
    from lightning_trainopt.metrics import frozen_weights

    torch.manual_seed(0)
    n = 24
    frozen = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(n)]).requires_grad_(False)
    calls: list[int] = []
    real = frozen_weights._is_cast_of

    def counting(t: torch.Tensor, p: torch.Tensor) -> bool:
        calls.append(1)
        return real(t, p)

    monkeypatch.setattr(frozen_weights, "_is_cast_of", counting)
    x = torch.randn(4, 16, requires_grad=True)  # every layer's input needs a gradient: each saves its weight's copy
    with SavedTensorsCounter(params=frozen.parameters()) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        frozen(x)
    assert counter.report().weight_copy_bytes == n * 16 * 16 * 2
    assert len(calls) == n


@pytest.mark.parametrize("shape", [(1536, 1024), (2, 1_200_000)])
def test_confirming_a_copy_never_casts_a_whole_weight(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int]) -> None:
    # The check runs inside the measured step: on CUDA a whole-weight temporary would raise the peak it reports.
    # Every storage the check allocates is recorded (views of existing ones are not); the largest must be a bounded
    # chunk (rows, or part of one row), not the weight cast to bf16.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from lightning_trainopt.metrics import frozen_weights

    allocated: list[int] = []

    class RecordAllocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            inputs = {
                t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            }
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    allocated.append(t.untyped_storage().nbytes())
            return out

    real = SavedTensorsCounter._is_frozen_weight_copy

    def recorded(self: SavedTensorsCounter, t: torch.Tensor) -> bool:
        with RecordAllocations():
            return real(self, t)

    monkeypatch.setattr(SavedTensorsCounter, "_is_frozen_weight_copy", recorded)
    weight = nn.Parameter(torch.randn(shape), requires_grad=False)
    cast = weight.detach().to(torch.bfloat16)
    a = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    with SavedTensorsCounter(params=[weight]) as counter:
        a * cast  # saves cast for a's gradient
    assert counter.report().weight_copy_bytes == weight.numel() * 2
    assert allocated
    assert max(allocated) < 2 * weight.numel()  # smaller than the whole weight cast to bf16
    assert max(allocated) <= 2 * frozen_weights._CHUNK_NUMEL  # one bf16 chunk


def test_frozen_half_weight_cast_up_is_a_copy() -> None:
    # A dtype autocast does not lower to (a bf16 weight cast to fp32): its fingerprints are built when first needed.
    torch.manual_seed(0)
    base = nn.Linear(16, 8, bias=False).to(torch.bfloat16).requires_grad_(False)
    a = torch.randn(8, 16, requires_grad=True)
    with SavedTensorsCounter(params=base.parameters()) as counter:
        a * base.weight.float()
    report = counter.report()
    assert report.weight_copy_bytes == 8 * 16 * 4
    assert report.activation_bytes == 8 * 16 * 4


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
