"""The chunked distillation loss against the direct computation from whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.chunked_loss import head_returns_loss
from lightning_trainopt.transforms.distill_loss import (
    DistillHeadLoss,
    TeacherOutputs,
    chunked_distillation_loss,
    distillation_loss,
)

V, D, DT, N = 37, 8, 12, 23


def _inputs(seed: int = 0, bias: bool = False) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[2, 9, 10]] = -100
    return {
        "hidden": torch.randn(N, D, generator=g, dtype=torch.float32, requires_grad=True),
        "weight": torch.randn(V, D, generator=g, dtype=torch.float32, requires_grad=True),
        "bias": torch.randn(V, generator=g, dtype=torch.float32, requires_grad=True) if bias else None,
        "t_hidden": torch.randn(N, DT, generator=g, dtype=torch.float32),
        "t_weight": torch.randn(V, DT, generator=g, dtype=torch.float32),
        "targets": targets,
    }


def _by_hand(x: dict, alpha: float, temperature: float, kind: str) -> torch.Tensor:
    """The formula written out token by token, independently of both implementations."""
    zs = F.linear(x["hidden"], x["weight"], x["bias"])
    zt = x["t_weight"] @ x["t_hidden"].T
    total_ce, total_kl, n = 0.0, 0.0, 0
    for i, t in enumerate(x["targets"].tolist()):
        if t == -100:
            continue
        n += 1
        total_ce = total_ce - torch.log_softmax(zs[i], -1)[t]
        ps, pt = torch.softmax(zs[i] / temperature, -1), torch.softmax(zt.T[i] / temperature, -1)
        p, q = (pt, ps) if kind == "forward" else (ps, pt)
        total_kl = total_kl + (p * (p.log() - q.log())).sum()
    return (1 - alpha) * total_ce / n + alpha * temperature**2 * total_kl / n


@pytest.mark.parametrize(
    ("alpha", "temperature", "kind"),
    [(0.5, 1.0, "forward"), (0.3, 2.5, "reverse"), (1.0, 4.0, "forward"), (0.0, 2.0, "reverse")],
)
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_direct_values_and_grads(alpha: float, temperature: float, kind: str, bias: bool) -> None:
    x = _inputs(bias=bias)
    params = [t for t in (x["hidden"], x["weight"], x["bias"]) if t is not None]
    expected = _by_hand(x, alpha, temperature, kind)
    direct = distillation_loss(
        F.linear(x["hidden"], x["weight"], x["bias"]),
        x["t_hidden"] @ x["t_weight"].T,
        x["targets"],
        alpha=alpha,
        temperature=temperature,
        kind=kind,  # type: ignore[arg-type]
    )
    ref_grads = torch.autograd.grad(direct.loss, params)
    torch.testing.assert_close(direct.loss, expected)
    for chunk in (1, 5, 64):
        terms = chunked_distillation_loss(
            x["hidden"],
            x["weight"],
            x["t_hidden"],
            x["t_weight"],
            x["targets"],
            bias=x["bias"],
            alpha=alpha,
            temperature=temperature,
            kind=kind,
            chunk_tokens=chunk,  # type: ignore[arg-type]
        )
        torch.testing.assert_close(terms.loss, expected)
        torch.testing.assert_close(terms.ce, direct.ce)
        torch.testing.assert_close(terms.kl, direct.kl)
        grads = torch.autograd.grad(terms.loss * 3.0, params)  # backward scales by the upstream gradient
        for got, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, 3.0 * ref, rtol=1e-4, atol=1e-5)


def test_forward_and_reverse_differ_and_kl_vanishes_on_the_teacher_itself() -> None:
    x = _inputs()
    args = (x["hidden"], x["weight"], x["t_hidden"], x["t_weight"], x["targets"])
    fwd = chunked_distillation_loss(*args, kind="forward", temperature=2.0)
    rev = chunked_distillation_loss(*args, kind="reverse", temperature=2.0)
    assert fwd.kl.item() > 0
    assert rev.kl.item() > 0
    assert abs(fwd.kl.item() - rev.kl.item()) > 1e-6
    same = chunked_distillation_loss(x["t_hidden"], x["t_weight"], x["t_hidden"], x["t_weight"], x["targets"])
    assert same.kl.abs().item() < 1e-6


def test_teacher_gets_no_gradient_and_no_grad_mode_keeps_none() -> None:
    x = _inputs()
    t_w = x["t_weight"].clone().requires_grad_(True)
    terms = chunked_distillation_loss(x["hidden"], x["weight"], x["t_hidden"], t_w, x["targets"])
    terms.loss.backward()
    assert t_w.grad is None
    assert x["hidden"].grad is not None
    with torch.no_grad():
        value = chunked_distillation_loss(x["hidden"], x["weight"], x["t_hidden"], x["t_weight"], x["targets"])
    assert not value.loss.requires_grad
    torch.testing.assert_close(value.loss, terms.loss.detach())


def test_bad_settings_are_refused_naming_the_key() -> None:
    for kwargs, key in (
        ({"alpha": 1.5}, "distill.alpha"),
        ({"temperature": 0.0}, "distill.temperature"),
        ({"kind": "js"}, "distill.kind"),
        ({"chunk_tokens": 0}, "distill.chunk_tokens"),
    ):
        with pytest.raises(ConfigError, match=key):
            DistillHeadLoss(**kwargs)  # type: ignore[arg-type]


def test_head_loss_runs_inside_the_student_heads_call() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(D, V, bias=False)
    hidden = torch.randn(2, 6, D, requires_grad=True)
    t_hidden, t_weight = torch.randn(2, 6, DT), torch.randn(V, DT)
    y = torch.randint(0, V, (2, 6))
    loss = DistillHeadLoss(alpha=0.7, temperature=2.0, chunk_tokens=4)
    with loss.teacher_batch(TeacherOutputs(t_hidden, t_weight)), head_returns_loss(head, loss, y):
        value = head(hidden)
    ref = distillation_loss(head(hidden), t_hidden @ t_weight.T, y, alpha=0.7, temperature=2.0)
    torch.testing.assert_close(value, ref.loss)
    assert loss.last is not None
    torch.testing.assert_close(loss.last.kl, ref.kl)
    with pytest.raises(RuntimeError, match="teacher_batch"):
        loss.compute(head, hidden, y)
