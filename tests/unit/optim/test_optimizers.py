from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError, MissingDependencyError
from lightning_trainopt.optim import optimizers
from lightning_trainopt.optim.optimizer_states import optimizer_state_bytes
from lightning_trainopt.optim.optimizers import adamw, bitsandbytes_optimizer, torchao_optimizer
from tests.helpers.runif import RunIf


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 64x128 = 8192 elements (8-bit state in bnb), bias 128 elements (fp32 state: below min_8bit_size).
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64, bias=False))


def _step(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()


def test_adamw_state_is_eight_bytes_per_param() -> None:
    model = _model()
    opt = adamw(model.parameters(), lr=1e-3, betas=[0.9, 0.95])
    assert not opt.defaults["fused"]  # CPU parameters: no fused kernel
    _step(opt, model)
    report = optimizer_state_bytes(opt)
    n = sum(p.numel() for p in model.parameters())
    assert report.n_params == n
    assert report.full_params == n
    assert report.quantised_params == 0
    # Two fp32 moments per element plus one fp32 `step` scalar per tensor (3 tensors).
    assert report.state_bytes == 8 * n + 3 * 4
    with pytest.raises(ConfigError, match="optimizer.fused"):
        adamw(model.parameters(), fused=True)


def test_state_bytes_before_a_step_are_zero() -> None:
    model = _model()
    report = optimizer_state_bytes(adamw(model.parameters()))
    assert report.state_bytes == 0
    assert report.bytes_per_param == 0.0


@RunIf(bnb=True)
@pytest.mark.parametrize(
    ("name", "full_bpp"), [("AdamW8bit", 8), ("Adam8bit", 8), ("PagedAdamW8bit", 8), ("Lion8bit", 4)]
)
def test_bitsandbytes_mix_of_8bit_and_fp32_states(name: str, full_bpp: int) -> None:
    model = _model()
    opt = bitsandbytes_optimizer(model.parameters(), name=name, lr=1e-3, betas=[0.9, 0.99])
    before = [p.detach().clone() for p in model.parameters()]
    with (
        pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU")
        if name.startswith("Paged")
        else _nullcontext()
    ):
        _step(opt, model)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    report = optimizer_state_bytes(opt)
    big = 64 * 128 + 128 * 64
    assert report.quantised_params == big
    assert report.full_params == 128
    per_big = report.quantised_bytes / big
    assert 1.0 <= per_big <= 2.2  # 1 (Lion) or 2 (Adam) bytes per element, plus block absmax and quantile maps
    assert report.full_bytes / 128 >= full_bpp
    assert report.bytes_per_param < 4


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_bitsandbytes_validation() -> None:
    with pytest.raises(ConfigError, match="optimizer.name"):
        bitsandbytes_optimizer([], name="SGD8bit")
    with pytest.raises(ConfigError, match="optimizer.eps"):
        bitsandbytes_optimizer([], name="Lion8bit", eps=1e-8)
    with pytest.raises(ConfigError, match="optimizer.name"):
        torchao_optimizer([], name="AdamW2bit")


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(optimizers.importlib, "import_module", fail)
    with pytest.raises(MissingDependencyError, match=r"pip install torch==[0-9.]+ -e \"\.\[bnb\]\""):
        bitsandbytes_optimizer([nn.Parameter(torch.ones(2))], name="AdamW8bit")
    with pytest.raises(MissingDependencyError, match=r"pip install torch==[0-9.]+ -e \"\.\[torchao\]\""):
        torchao_optimizer([nn.Parameter(torch.ones(2))], name="AdamW4bit")


@RunIf(torchao=True)
def test_torchao_builds_low_bit_adamw() -> None:
    # Stepping compiles the update (about 100 s on 2 CPU cores): bench/memory_techniques.py measures its state.
    model = _model()
    opt = torchao_optimizer(model.parameters(), name="AdamW4bit", lr=1e-3, betas=[0.9, 0.95], block_size=128)
    assert type(opt).__name__ == "AdamW4bit"
    assert opt.defaults["lr"] == 1e-3


class _FakeParam:
    """Stands in for a CUDA parameter in the pure decision (no GPU needed)."""

    def __init__(self, cuda: bool = True, floating: bool = True) -> None:
        self.is_cuda = cuda
        self._floating = floating

    def is_floating_point(self) -> bool:
        return self._floating


def test_fused_kernel_chosen_only_where_safe() -> None:
    from functools import partial

    from lightning_trainopt.optim.optimizers import fused_adam_kwargs

    preset = partial(torch.optim.AdamW, lr=1e-3)
    cuda = [_FakeParam(), _FakeParam()]

    def choose(factory=preset, params=cuda, precision="bf16-mixed", clip=1.0, deepspeed=False):
        return fused_adam_kwargs(factory, params, precision, clip, deepspeed)

    assert choose() == {"fused": True}
    assert choose(factory=partial(torch.optim.Adam)) == {"fused": True}
    assert choose(precision="16-mixed", clip=None) == {"fused": True}
    assert choose(precision="16-mixed", clip=1.0) == {}  # Lightning refuses clipping for a fused optimizer
    assert choose(deepspeed=True) == {}
    assert choose(params=[_FakeParam(), _FakeParam(cuda=False)]) == {}
    assert choose(params=[_FakeParam(floating=False)]) == {}
    assert choose(params=[]) == {}
    assert choose(factory=partial(torch.optim.AdamW, fused=False)) == {}  # the user's choice wins
    assert choose(factory=partial(torch.optim.AdamW, foreach=True)) == {}
    assert choose(factory=partial(torch.optim.SGD, lr=0.1)) == {}
    assert choose(factory=adamw) == {}  # our own factory decides for itself


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize(("precision", "clip", "fused"), [("bf16-mixed", 1.0, True), ("16-mixed", 1.0, False)])
def test_adamw_preset_is_fused_on_cuda_where_lightning_allows_it(precision, clip, fused) -> None:
    from functools import partial

    from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer

    module = tiny_module(optimizer=partial(torch.optim.AdamW, lr=1e-3))
    trainer = tiny_trainer([], max_steps=2, accelerator="gpu", precision=precision, gradient_clip_val=clip)
    trainer.fit(module, tiny_data())
    assert bool(trainer.optimizers[0].defaults["fused"]) is fused
