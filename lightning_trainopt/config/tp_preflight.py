"""Pre-flight of tensor parallelism (``+strategy=tp|fsdp_tp``): what the TP size must divide, and where it belongs.

Run from :func:`~lightning_trainopt.config.preflight.preflight_from_cfg`, in the launching process, before any rank
starts: the TP size must not exceed a node's devices, and it must divide the model's attention heads, key/value
heads, FFN width and vocabulary, and the sequence length (sequence parallelism splits it); the model must have a
plan (:data:`~lightning_trainopt.parallel.tp.ARCHITECTURES`).
"""

from __future__ import annotations

from typing import Any

from lightning_trainopt.config.parallel_dims import parallel_dims_from_cfg, resolved_devices
from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.parallel.tp import (
    ARCHITECTURES,
    architecture_of,
    inner_model,
    model_shape,
    tp_divisibility_errors,
)

__all__ = ["check_float8_tensor_parallel", "check_tensor_parallel", "tensor_parallel_size"]

_TP_STRATEGY = "TrainOptTPStrategy"


def tensor_parallel_size(cfg: Any) -> int:
    """The run's tensor-parallel size (1 without tensor parallelism, or when the device count is not known)."""
    dims = parallel_dims_from_cfg(cfg)
    return 1 if dims is None else dims.tp


def check_tensor_parallel(cfg: Any) -> None:
    """Refuse a tensor-parallel config that cannot run, naming the key, its value and the fix.

    Raises:
        IncompatibleConfigError: TP larger than a node's devices; a model without a plan; a size TP does not divide.
    """
    strategy = cfg.get("strategy")
    if not hasattr(strategy, "get") or not str(strategy.get("_target_", "")).endswith(_TP_STRATEGY):
        return
    devices = resolved_devices(cfg.trainer)
    asked = strategy.get("tensor_parallel_size", "auto")
    # Before the split of the world is worked out: on several nodes it would divide, and still cross the network.
    tp = asked if isinstance(asked, int) and not isinstance(asked, bool) else 1
    if devices is not None and tp > devices:
        raise IncompatibleConfigError(
            {"strategy.tensor_parallel_size": tp, "trainer.devices": devices},
            f"tensor parallelism of {tp} ranks is larger than a node's {devices} devices: TP all-gathers and "
            "reduce-scatters activations in every layer, which needs the bandwidth inside a node (NVLink), not "
            "the network between nodes.",
            f"use strategy.tensor_parallel_size<={devices} and scale across nodes with data parallelism "
            "(+strategy=fsdp_tp, strategy.replicate for HSDP).",
        )
    tp = tensor_parallel_size(cfg)
    if tp == 1:
        return
    check_float8_tensor_parallel(cfg, tp)
    from lightning_trainopt.config.model_factory import meta_module, model_kind

    model = cfg.get("model")
    if model is None or model_kind(model) == "module":
        return  # a user's module: refused at configure time if its model has no plan
    inner = inner_model(meta_module(cfg))
    if architecture_of(inner) is None:
        found = getattr(getattr(inner, "config", None), "model_type", None) or type(inner).__name__
        raise IncompatibleConfigError(
            {"model": found, "strategy.tensor_parallel_size": tp},
            f"tensor parallelism has no plan for {found}.",
            f"use a model with a plan ({', '.join(ARCHITECTURES)}), or a data-parallel strategy (+strategy=fsdp).",
        )
    seq_len = (cfg.get("data") or {}).get("seq_len")
    bad = tp_divisibility_errors(model_shape(inner), tp, seq_len if isinstance(seq_len, int) else None)
    if bad:
        raise IncompatibleConfigError(
            {"strategy.tensor_parallel_size": tp, "model": str(model.get("name", "")) or found_name(inner)},
            f"tensor parallelism of {tp} ranks splits the heads, KV heads, FFN width and vocabulary, and sequence "
            f"parallelism the sequence; these are not divisible by {tp}: {', '.join(bad)}.",
            "use a strategy.tensor_parallel_size that divides them (or change the model's sizes / data.seq_len).",
        )


def found_name(model: Any) -> str:
    """The model's ``model_type`` or class name, for messages."""
    return getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__


def check_float8_tensor_parallel(cfg: Any, tp: int) -> None:
    """Refuse torchao FP8 with tensor parallelism where it cannot run: a recipe other than ``tensorwise`` (torchao's
    float8 tensor-parallel plans cast with one scale per tensor), and sequence parallelism on CPU (it all-gathers
    float8 activations, and gloo has no float8 type; NCCL has).

    Raises:
        IncompatibleConfigError: naming ``precision.recipe`` or ``strategy.sequence_parallel``.
    """
    import torch

    precision = cfg.get("precision") or {}
    if precision.get("backend") != "torchao":
        return
    recipe = precision.get("recipe") or "tensorwise"
    if recipe != "tensorwise":
        raise IncompatibleConfigError(
            {"precision.recipe": recipe, "strategy.tensor_parallel_size": tp},
            "torchao's float8 tensor-parallel plans (Float8ColwiseParallel, Float8RowwiseParallel) cast activations "
            "with one scale per tensor; the row-wise recipes need per-row scales of the whole tensor.",
            "use precision.recipe=tensorwise with tensor parallelism.",
        )
    strategy = cfg.get("strategy")
    trainer = cfg.get("trainer") or {}
    on_cpu = str(trainer.get("accelerator", "auto")) == "cpu" or not torch.cuda.is_available()
    if strategy.get("sequence_parallel", True) and on_cpu:
        raise IncompatibleConfigError(
            {
                "precision": precision.get("name", "fp8"),
                "strategy.sequence_parallel": True,
                "trainer.accelerator": "cpu",
            },
            "with sequence parallelism torchao's float8 tensor-parallel plans all-gather float8 activations, and "
            "gloo (CPU) has no float8 type (it fails with 'Invalid scalar type'); only NCCL (GPUs) can.",
            "set strategy.sequence_parallel=false: FP8 tensor parallelism without float8 collectives (the residual "
            "stream replicated, row-parallel outputs all-reduced in bf16), or run on GPUs.",
        )
