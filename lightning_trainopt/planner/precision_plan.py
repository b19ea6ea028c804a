"""What a precision preset and a loss change in a run, as plain values the planner reads.

:class:`PrecisionPlan`: the layers an FP8 preset converts (their shapes, from the same decisions the run makes:
``precision.layer_filter.plan_layers``), the fp32-kept modules, and — where the bytes saved for backward change —
a callable that measures them on fake tensors under the real conversion (torchao's ``Float8Linear`` runs on fake
tensors; Transformer Engine does not run on a CPU, so its bytes are derived per converted layer:
:func:`te_saved_delta`). :class:`LossPlan`: the loss that runs after the output head (``loss=standard``,
``chunked_ce``, ``liger``), which decides whether the logits are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.terms import Term

__all__ = ["LOSS_KINDS", "LossPlan", "PrecisionPlan", "fp8_transient_term", "te_saved_delta"]

#: ``standard``: logits then ``F.cross_entropy`` (the logits' fp32 log-softmax kept); ``chunked``: our
#: ``ChunkedLMHeadLoss`` (hidden states + one fp32 log-sum-exp per token kept); ``liger``: Liger-Kernel's fused
#: linear cross-entropy (gradients written in forward and kept).
LOSS_KINDS = ("standard", "chunked", "liger")

ActivationsFn = Callable[..., object]


@dataclass(frozen=True)
class LossPlan:
    """The loss after the output head.

    Args:
        name: preset name (``standard``, ``chunked_ce``, ``liger``), for reports and commands.
        kind: one of :data:`LOSS_KINDS`.
        chunk_tokens: tokens per chunk of the chunked loss (``loss.chunk_tokens``).
    """

    name: str = "standard"
    kind: str = "standard"
    chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ConfigError("loss", self.name, f"the planner models the losses {', '.join(LOSS_KINDS)}.")
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ConfigError("loss.chunk_tokens", self.chunk_tokens, "use a positive number of tokens, e.g. 1024.")


@dataclass(frozen=True, eq=False)
class PrecisionPlan:
    """The model changes of one precision preset (``conf/precision``), as the planner counts them.

    Args:
        name: preset name (``fp8``, ``fp8_te``, ``bf16`` with ``keep_fp32``).
        backend: ``torchao``, ``transformer_engine``, or ``None`` (only fp32-kept modules).
        recipe: the FP8 scaling recipe.
        fp8_shapes: ``(out_features, in_features)`` of each converted linear layer (each runs once per token per
            forward, as in a transformer).
        linear_shapes: the same of every linear layer (converted or not), for the converted share.
        fp32_modules: names of the modules kept in fp32.
        emulated: torchao's FP8 GEMMs are emulated in fp32 (planned for a CPU): no FP8 speed-up.
        measure: ``loss kind -> activations function`` (``model_profile.ActivationsFn``) measured on fake tensors
            with the real conversion applied; ``None`` when the bytes are derived (Transformer Engine).
    """

    name: str
    backend: str | None = None
    recipe: str | None = None
    fp8_shapes: tuple[tuple[int, int], ...] = ()
    linear_shapes: tuple[tuple[int, int], ...] = ()
    fp32_modules: tuple[str, ...] = ()
    emulated: bool = False
    measure: Callable[[str], ActivationsFn] | None = None

    @property
    def fp8(self) -> bool:
        return self.backend is not None and bool(self.fp8_shapes)

    @property
    def fp8_flops_per_token(self) -> int:
        """Model FLOPs per token (forward + backward, 3 x 2 x N x K per layer) of the converted layers."""
        return 6 * sum(n * k for n, k in self.fp8_shapes)

    @property
    def fp8_weight_fraction(self) -> float | None:
        """The converted share of the linear layers' weight elements (``None`` without linear layers)."""
        total = sum(n * k for n, k in self.linear_shapes)
        return sum(n * k for n, k in self.fp8_shapes) / total if total else None

    def to_dict(self) -> dict[str, object]:
        return {
            "preset": self.name,
            "backend": self.backend,
            "recipe": self.recipe,
            "emulated": self.emulated,
            "fp8_layers": len(self.fp8_shapes) if self.backend else None,
            "linear_layers": len(self.linear_shapes) if self.backend else None,
            "fp8_weight_fraction": self.fp8_weight_fraction if self.backend else None,
            "fp32_modules": list(self.fp32_modules),
            "activations": "measured (fake tensors, real conversion)" if self.measure is not None else "derived",
        }


def te_saved_delta(plan: PrecisionPlan, tokens: int, compute_bytes: int) -> Term:
    """Transformer Engine's change to the bytes saved for backward, derived per converted layer (it cannot run on a
    CPU, so it is not measured): ``te.Linear`` saves its input cast to FP8 (1 B per element, instead of the
    autocast copy of ``compute_bytes``) with an fp32 scale-inverse, and its FP8 weight (1 B per element, instead of
    the autocast half copy of 2 B). Read in Transformer Engine's ``pytorch/module/linear.py`` (``_Linear.forward``:
    ``saved_inputmat = inputmat``, the quantized input kept with its column-wise data only, and the quantized
    ``weightmat``, both saved for backward)."""
    inputs = sum(k for _, k in plan.fp8_shapes)
    weights = sum(n * k for n, k in plan.fp8_shapes)
    layers = len(plan.fp8_shapes)
    delta = (1 - compute_bytes) * tokens * inputs + (1 - 2) * weights + 2 * 4 * layers
    return Term(
        "activations",
        "device",
        "Transformer Engine: FP8 inputs and weights instead of half copies (derived)",
        delta,
        f"{layers} layers: (1 - {compute_bytes}) B x {tokens:,} tok x {inputs:,} inputs - 1 B x {weights:,} weights "
        "+ fp32 scales",
        phase="backward",
    )


def fp8_transient_term(plan: PrecisionPlan, tokens: int) -> Term | None:
    """The FP8 copies one converted layer holds while its GEMMs run (derived): the input and the weight cast to FP8 in
    forward (torchao recasts them in backward, with the output gradient), 1 B per element, and their fp32 scales —
    the largest layer's, since they are freed layer by layer. ``None`` without FP8 layers."""
    if not plan.fp8_shapes:
        return None
    n, k = max(plan.fp8_shapes, key=lambda s: tokens * (s[0] + s[1]) + s[0] * s[1])
    # Scales: one fp32 per tensor (tensorwise, Transformer Engine), one per row of each operand (rowwise).
    scales = 4 * (2 * tokens + n) if (plan.recipe or "").startswith("rowwise") else 3 * 4
    nbytes = tokens * (k + n) + n * k + scales
    return Term(
        "other",
        "device",
        "FP8 casts of the largest converted layer (backward, derived)",
        nbytes,
        f"1 B x ({tokens:,} tok x ({k} in + {n} out) + {n}x{k} weight) + fp32 scales",
        phase="backward",
    )
