"""The planner's view of a precision preset's model changes and of the loss: :class:`PrecisionPlan`, :class:`LossPlan`.

Which layers an FP8 preset converts is decided by ``precision.layer_filter.plan_layers`` on the model built on the
meta device — the function the run's conversion calls — so the plan and the run agree layer by layer. The bytes saved
for backward under the conversion are measured on fake tensors with the real conversion applied (torchao's
``Float8Linear`` and the fp32-kept modules run there, as they run on a CPU); Transformer Engine cannot run on a CPU,
so its change is derived per converted layer (``planner.precision_plan.te_saved_delta``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner import ActivationPolicy, LossPlan, PrecisionPlan
from lightning_trainopt.planner.activations import loss_transient
from lightning_trainopt.planner.terms import MemoryEstimate, Term

__all__ = ["attention_kind", "gpt_loss_fn", "loss_plan", "precision_plan", "precision_spec", "with_planned_loss"]

_LOSS_KINDS = {"ChunkedLMHeadLoss": "chunked", "LigerLMHeadLoss": "liger"}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def loss_plan(node: Any, name: str | None = None) -> LossPlan | None:
    """The loss of a ``conf/loss`` node (``cfg.loss``): ``None`` for the standard cross-entropy (no node, or no
    ``_target_``), else the chunked or Liger loss with its ``chunk_tokens``.

    Raises:
        ConfigError: a ``_target_`` the planner does not model.
    """
    plain = _plain(node)
    if not isinstance(plain, dict) or not plain.get("_target_"):
        return None
    target = str(plain["_target_"])
    cls = target.rsplit(".", 1)[-1]
    if cls not in _LOSS_KINDS:
        raise ConfigError("loss._target_", target, f"the planner models {', '.join(_LOSS_KINDS)} (or no loss node).")
    kind = _LOSS_KINDS[cls]
    label = name or str(plain.get("name") or ("chunked_ce" if kind == "chunked" else kind))
    return LossPlan(label, kind, int(plain.get("chunk_tokens", 1024)))


def with_planned_loss(module: nn.Module, cfg: DictConfig) -> nn.Module:
    """``module`` (built on the meta device, where ``meta_module`` leaves the loss out) with the chunked loss the
    run uses, for a measured module that takes one (``head_loss``: ``model=hf``); ``loss=liger`` (CUDA only) is
    measured as the chunked loss, which keeps the log-sum-exp where Liger keeps the head weight's gradient."""
    plan = loss_plan(cfg.get("loss"))
    if plan is None or not hasattr(module, "head_loss") or module.__class__.__name__ == "LitGPT":
        return module
    from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss

    setattr(module, "head_loss", ChunkedLMHeadLoss(plan.chunk_tokens))  # setattr: mypy types it as a Module
    return module


def attention_kind(cfg: DictConfig) -> str:
    """What the planner plans for attention: ``math`` (keeps the ``T x T`` scores) or ``sdpa`` (every other kernel:
    SDPA's flash, memory-efficient, cuDNN, or flash-attn, none of which keeps them), from ``model.attention`` (the
    kernel the run uses) and ``plan.attention`` (SDPA's choice, when the run leaves it to SDPA).

    Raises:
        ConfigError: ``plan.attention=math`` with a ``model.attention`` that names another kernel.
    """
    model = str((cfg.get("model") or {}).get("attention") or "sdpa")
    planned = str((cfg.get("plan") or {}).get("attention", "sdpa"))
    if model == "math":
        return "math"
    if planned == "math" and model != "sdpa":
        raise ConfigError(
            "plan.attention",
            planned,
            f"model.attention={model} runs that kernel, which keeps no T x T scores; drop plan.attention=math, or "
            "plan model.attention=math.",
        )
    return planned


def precision_spec(node: Any) -> Any:
    """The ``PrecisionSpec`` (or ``FP8PrecisionSpec``) of a ``conf/precision`` node, built by calling its
    ``_target_`` (not Hydra's ``instantiate``, which would wrap the spec's ``ConfigError``)."""
    from hydra.utils import get_method

    plain = dict(_plain(node) or {})
    target = plain.pop("_target_", "lightning_trainopt.precision.PrecisionSpec")
    return get_method(str(target))(**{k: v for k, v in plain.items() if not str(k).startswith("_")})


def gpt_loss_fn(kind: str, chunk_tokens: int = 1024) -> Callable[[nn.Module, Any], torch.Tensor]:
    """``(LitGPT, (x, y)) -> loss`` as training computes it with that loss: the module's own ``training_step``
    with its ``head_loss`` set as ``loss=`` sets it (``None``: logits and ``F.cross_entropy``; ``chunked``:
    ``ChunkedLMHeadLoss``, which the model's forward runs inside the head's call)."""
    from lightning_trainopt.config.plan_model import training_loss
    from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss

    def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
        # On the measured (fake) copy only: the meta module the planner reads keeps no loss (meta_module).
        setattr(module, "head_loss", None if kind == "standard" else ChunkedLMHeadLoss(chunk_tokens))
        loss: torch.Tensor = training_loss(module, batch)
        return loss

    return loss_fn


@contextlib.contextmanager
def _float8_sees_cpu_autocast() -> Iterator[None]:
    """Let torchao's ``Float8Linear`` see the CPU autocast of the measurement as a GPU run's autocast.

    ``Float8Linear.forward`` casts its input to the autocast dtype only when ``torch.is_autocast_enabled()`` (CUDA's)
    says so: on a GPU it saves a bf16 input, on a CPU an fp32 one. Planning for a GPU on this CPU, the measurement
    answers with the CPU autocast state, so it saves what the GPU run saves. For the measurement only.
    """
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_gpu_dtype

    def is_enabled(*args: Any) -> bool:
        return enabled(*args) if args else enabled("cpu")

    def gpu_dtype() -> torch.dtype:
        return torch.get_autocast_dtype("cpu")

    torch.is_autocast_enabled = is_enabled  # type: ignore[assignment]
    torch.get_autocast_gpu_dtype = gpu_dtype  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_autocast_enabled = enabled
        torch.get_autocast_gpu_dtype = dtype


def _liger_delta(
    measured: MemoryEstimate, d: int, vocab: int, tokens: int, weight_bytes: int
) -> MemoryEstimate:  # pragma: no cover - liger needs CUDA; derived from its source
    term = Term(
        "activations",
        "device",
        "Liger: head-weight gradient kept instead of the log-sum-exp (derived)",
        weight_bytes * vocab * d - 4 * tokens - 8,
        f"{weight_bytes} B x V x d - 4 B x {tokens:,} tok",
        phase="backward",
    )
    return measured + MemoryEstimate.of([term])


def precision_plan(cfg: DictConfig, node: Any, on_cuda: bool, name: str | None = None) -> PrecisionPlan | None:
    """The model changes of the precision preset ``node`` for the model of ``cfg``, or ``None`` when it changes none
    (no FP8, no ``keep_fp32``).

    Args:
        cfg: the composed config (its model, built on the meta device, and its loss).
        node: the ``precision`` node (the config's, or a search candidate's preset).
        on_cuda: the planned hardware is a GPU (torchao runs real FP8 GEMMs there; emulated on a CPU).
        name: the preset name (default: the node's ``name``).

    Raises:
        ConfigError: the preset is invalid, or the model's training step does not run on fake tensors.
    """
    from lightning_trainopt.config.model_factory import meta_module, model_kind
    from lightning_trainopt.precision import FP8PrecisionSpec, PrecisionSpec, plan_layers

    spec = precision_spec(node)
    fp8 = spec if isinstance(spec, FP8PrecisionSpec) else None
    if fp8 is None and not spec.transforms_model:
        return None
    module = with_planned_loss(meta_module(cfg), cfg)
    decisions = plan_layers(
        module,
        spec.keep_fp32,
        fp8_recipe=fp8.recipe if fp8 else None,
        include=fp8.include if fp8 else (),
        exclude=fp8.exclude if fp8 else (),
        convert_lm_head=fp8.convert_lm_head if fp8 else False,
        skip_small=fp8.skip_small if fp8 else True,
        te_norms=fp8.is_te if fp8 else False,
    )
    te = fp8 is not None and fp8.is_te
    emulate = bool(fp8 is not None and not te and (fp8.emulate if fp8.emulate is not None else not on_cuda))
    kept = tuple(d.name for d in decisions if d.action == "fp32")
    if te and not kept:
        measure = None  # nothing that runs on a CPU changes: Transformer Engine's bytes are derived
    else:
        # Transformer Engine's layers are left out of the measurement (derived on top); the fp32-kept modules in.
        measured_spec = (
            PrecisionSpec(name=spec.name, trainer_precision=spec.trainer_precision, keep_fp32=spec.keep_fp32)
            if te
            else spec
        )
        measure = _measurer(cfg, module, measured_spec, emulate, on_cuda and not te, model_kind(cfg.model) == "gpt")
    return PrecisionPlan(
        name=name or str(getattr(spec, "name", "")),
        backend=fp8.backend if fp8 else None,
        recipe=fp8.recipe if fp8 else None,
        fp8_shapes=tuple(d.shape for d in decisions if d.action == "fp8" and d.shape is not None),
        linear_shapes=tuple(d.shape for d in decisions if d.shape is not None),
        fp32_modules=kept,
        emulated=emulate,
        measure=measure,
    )


def _measurer(
    cfg: DictConfig, module: nn.Module, spec: Any, emulate: bool, gpu_autocast: bool, gpt: bool
) -> Callable[[str], Any]:
    """``loss kind -> activations function`` measuring ``module`` on fake tensors with ``spec``'s conversion."""
    from lightning_trainopt.config.plan_model import module_max_seq_len, module_plan_profile, training_loss
    from lightning_trainopt.precision.convert import convert_model

    def transform(fake: nn.Module) -> None:
        convert_model(fake, spec, emulate=emulate, fsdp=False)

    context = _float8_sees_cpu_autocast if gpu_autocast else contextlib.nullcontext
    chunk = int((_plain(cfg.get("loss")) or {}).get("chunk_tokens", 1024))

    @cache
    def for_loss(kind: str) -> Any:
        # Our model: the loss is the planned one (standard or chunked; Liger's is derived from the chunked one). Any
        # other module: its own training step.
        loss_fn = gpt_loss_fn("standard" if kind == "standard" else "chunked", chunk) if gpt else training_loss
        profile = module_plan_profile(
            module,
            str(spec.name),
            module_max_seq_len(module),
            make_batch=None,
            loss_fn=loss_fn,
            transform=transform,
            measure_context=context,
        )
        if not gpt or kind == "standard":
            return profile.activations
        shape: Any = module.config

        def with_head_loss(
            micro_batch: int,
            seq_len: int,
            compute_bytes: int,
            autocast: bool,
            policy: ActivationPolicy,
            attention: str,
        ) -> MemoryEstimate:
            acts = profile.activations(micro_batch, seq_len, compute_bytes, autocast, policy, attention)
            tokens = micro_batch * seq_len
            if kind == "chunked":
                # The measured output (the loss, a scalar) holds nothing; backward holds one chunk's logits (derived).
                loss = LossPlan("chunked_ce", "chunked", chunk)
                return acts + MemoryEstimate.of([loss_transient(shape, tokens, compute_bytes, loss)])
            weight_bytes = 2 if compute_bytes == 2 and not autocast else 4  # pragma: no cover - liger needs CUDA
            return _liger_delta(acts, shape.d_model, shape.vocab_size, tokens, weight_bytes)  # pragma: no cover

        return with_head_loss

    return for_loss
