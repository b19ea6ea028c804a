"""The planner's :class:`~lightning_trainopt.planner.ModelProfile` of any model built on the meta device.

Model states come from the module's parameters (``planner.module_profile``); activations are measured on fake
tensors with the real techniques applied (``transforms.checkpointing`` wraps the blocks as ``activations=checkpoint``
does in training; int8 and offload follow their rules storage by storage), lazily and once per configuration; FLOPs
are counted once by ``torch.utils.flop_counter`` on a meta copy (``metrics.flops.fit_seq_flops``) and fitted to
``B * (c + a*T + b*T^2)``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Collection, Iterator
from functools import cache
from typing import Any

import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.flops import SeqFlops, fit_seq_flops, meta_copy
from lightning_trainopt.planner import ActivationPolicy, ModelProfile, forward_trace, module_profile
from lightning_trainopt.planner.measure import (
    SavedStorages,
    fake_module,
    measure_saved_storages,
    measured_activation_terms,
)
from lightning_trainopt.planner.terms import MemoryEstimate
from lightning_trainopt.planner.tp_shape import TPShape

__all__ = [
    "BATCH_FORMATS",
    "module_max_seq_len",
    "module_plan_profile",
    "token_batch",
    "token_dict_batch",
    "training_loss",
]

Batch = Callable[[int, int], Any]


def token_batch(micro_batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the project's data modules yield it: ``(input ids, next-token targets)``, ``(B, T)`` int64 each.

    Without an attention mask a Hugging Face model takes SDPA's causal path (no ``T x T`` mask), as for packed
    sequences without padding.
    """
    x = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return x, torch.zeros(micro_batch, seq_len, dtype=torch.long)


def token_dict_batch(micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """A Hugging Face style batch of whole sequences: ``{input_ids, attention_mask (all ones), labels}``."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros_like(ids)}


#: The batches tried, in order, until the module's training step runs on one: our data's ``(x, y)``, then a dict.
BATCH_FORMATS: tuple[Batch, ...] = (token_batch, token_dict_batch)


def training_loss(module: nn.Module, batch: Any) -> Any:
    """What training backpropagates: a LightningModule's ``training_step(batch, 0)`` (its loss, or the ``loss`` of
    the dict it returns); a plain module's first output."""
    step = getattr(module, "training_step", None)
    if callable(step):
        out = step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out
    return module(batch[0] if isinstance(batch, (tuple, list)) else batch)


def _is_hf(module: nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformers.") for m in module.modules())


@contextlib.contextmanager
def _hf_masks_as_in_training() -> Iterator[None]:
    """Hugging Face's mask code decides on fake tensors as in a real run of a batch without padding.

    transformers' ``masking_utils`` keeps a full causal mask instead of SDPA's ``is_causal`` whenever a tensor is being
    traced (``is_tracing``), which it takes every fake tensor to be; SDPA then runs with a mask, and a model with
    grouped-query attention repeats its keys and values to all heads (``use_gqa_in_sdpa``): the measurement would not
    be the run's. Here ``is_tracing`` ignores fake tensors (compilation and export still count); the yes/no questions
    the mask code then asks of the batch (no padding? no packed sequences?) are answered yes by
    ``MetaTruthValues(fake=True)`` in :func:`measure_saved_storages`, as a batch of whole sequences answers them.
    For the measurement only; without transformers, or a version without that function, nothing changes.
    """
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "is_tracing", None)
    if masking is None or original is None:
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return bool(original(None))

    setattr(masking, "is_tracing", is_tracing)  # setattr: mypy does not know the attribute
    try:
        yield
    finally:
        setattr(masking, "is_tracing", original)


def _checkpointed(module: nn.Module, every_k: int) -> nn.Module:
    if every_k:
        from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing

        apply_activation_checkpointing(module, CheckpointPolicy(every_k=every_k))
    return module


def _dtype(compute_bytes: int, autocast: bool) -> torch.dtype:
    # fp32 weights under autocast (Lightning's -mixed) and in fp32; half weights otherwise (-true, DeepSpeed).
    return torch.float32 if compute_bytes == 4 or autocast else torch.bfloat16


def module_plan_profile(
    module: nn.Module,
    name: str,
    max_seq_len: int | None = None,
    make_batch: Batch | None = None,
    loss_fn: Callable[[nn.Module, Any], Any] = training_loss,
    transform: Callable[[nn.Module], None] | None = None,
    measure_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    tp: tuple[TPShape | None, Collection[int]] = (None, ()),
) -> ModelProfile:
    """The profile of ``module`` (a LightningModule with its model built on ``meta``, or any ``nn.Module``).

    Args:
        module: the model; only shapes are read, nothing is allocated.
        name: for reports.
        max_seq_len: longest sequence the model takes, when it says (a Hugging Face ``max_position_embeddings``).
        make_batch: ``(micro_batch, seq_len) -> batch`` as training feeds it; ``None``: the first of
            :data:`BATCH_FORMATS` the training step runs on.
        loss_fn: ``(module, batch) -> loss`` (default :func:`training_loss`).
        transform: applied to each fake copy before it is measured, before checkpointing wraps its blocks, as the
            precision plugin converts the model before the strategy and the callbacks see it (FP8 layers,
            fp32-kept modules: ``config.plan_precision``).
        tp: what a tensor-parallel plan splits of it and the ``id`` of each parameter it splits
            (``parallel.tp.tp_shape``, ``tp_sharded_parameters``); ``(None, ())``: no plan, TP is refused.
        measure_context: entered around each measurement (``config.plan_precision``: torchao's ``Float8Linear`` sees
            the CPU autocast as a GPU run's).

    Raises:
        ConfigError: the module's training step cannot run on fake tensors (the message names the error).
    """
    from lightning_trainopt.parallel.fsdp import block_classes

    blocks = block_classes(module)
    hf = _is_hf(module)
    masks = _hf_masks_as_in_training if hf else contextlib.nullcontext
    trace, batch_of = _trace(module, (make_batch,) if make_batch else BATCH_FORMATS, loss_fn, hf, name)

    def build(dtype: torch.dtype, every: int) -> nn.Module:
        fake = fake_module(module, dtype)
        if transform is not None:
            transform(fake)
        return _checkpointed(fake, every)

    @cache
    def measure(micro_batch: int, seq_len: int, dtype: torch.dtype, autocast: bool, every: int, math: bool) -> Any:
        try:
            with masks(), measure_context():
                return measure_saved_storages(
                    lambda: build(dtype, every),
                    lambda: batch_of(micro_batch, seq_len),
                    loss_fn,
                    torch.bfloat16 if autocast else None,
                    math,
                    truth_values=hf,
                )
        except Exception as err:  # the user's code may fail in any way on fake tensors: say which and how
            raise ConfigError(
                "model",
                name,
                f"its training step does not run on fake tensors at micro-batch {micro_batch} x {seq_len} tokens "
                f"({type(err).__name__}: {str(err).strip()[:200]}); the planner measures activations that way: make "
                "training_step run without a Trainer and without reading tensor values.",
            ) from err

    def activations(
        micro_batch: int, seq_len: int, compute_bytes: int, autocast: bool, policy: ActivationPolicy, attention: str
    ) -> MemoryEstimate:
        if micro_batch < 1:
            raise ConfigError("data.batch_size", micro_batch, "use a positive micro-batch size.")
        if max_seq_len is not None and not 1 <= seq_len <= max_seq_len:
            raise ConfigError("data.seq_len", seq_len, f"use 1..{max_seq_len} (the model's longest sequence).")
        dtype, math = _dtype(compute_bytes, autocast), attention == "math"
        saved: SavedStorages = measure(micro_batch, seq_len, dtype, autocast, policy.checkpoint_every, math)
        recomputed = 0
        if policy.checkpoint_every and n_blocks:
            full = measure(micro_batch, seq_len, dtype, autocast, 0, math).nbytes
            every_block = measure(micro_batch, seq_len, dtype, autocast, 1, math).nbytes
            recomputed = max(full - every_block, 0) // n_blocks
        return measured_activation_terms(saved, policy, compute_bytes, recomputed)

    fits: dict[int, SeqFlops] = {}

    def flops(micro_batch: int, seq_len: int) -> tuple[int, int]:
        if not fits:
            # One count with every block checkpointed gives the model FLOPs and the recomputed forward apart.
            counted = _checkpointed(meta_copy(module), 1 if n_blocks else 0)
            fits[0] = fit_seq_flops(counted, _meta(batch_of(1, seq_len)), 1, seq_len)
        fit = fits[0]
        model = fit(micro_batch, seq_len)
        return model, fit.hardware(micro_batch, seq_len) - model

    profile = module_profile(module, name, activations, flops, blocks, trace, max_seq_len, *tp)
    n_blocks = profile.n_blocks  # read by the two measuring closures above, which run only after this
    return profile


def _meta(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to("meta")
    if isinstance(batch, (tuple, list)):
        return type(batch)(_meta(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _meta(v) for k, v in batch.items()}
    return batch


def _trace(
    module: nn.Module, formats: tuple[Batch, ...], loss_fn: Callable[[nn.Module, Any], Any], hf: bool, name: str
) -> tuple[Any, Batch]:
    """The forward order of the module's parameter-owning modules (``forward_trace``) and the batch format its
    training step runs on, from one fake forward per format tried.

    Raises:
        ConfigError: the training step runs on none of the formats (the message names each error).
    """
    import warnings

    from lightning_trainopt._compat.torch_internals import MetaTruthValues, fake_tensor_mode

    masks = _hf_masks_as_in_training if hf else contextlib.nullcontext
    errors = []
    for make_batch in formats:
        truth = MetaTruthValues(fake=True) if hf else contextlib.nullcontext()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with fake_tensor_mode(), masks(), truth:
                    fake = fake_module(module)
                    batch = make_batch(1, 8)
                    return forward_trace(fake, lambda: loss_fn(fake, batch)), make_batch
        except Exception as err:  # the user's code may fail in any way on fake tensors: try the next format
            errors.append(f"{make_batch.__name__}: {type(err).__name__}: {str(err).strip()[:160]}")
    raise ConfigError(
        "model",
        name,
        "its training step runs on none of the batches the planner measures with (" + "; ".join(errors) + "). The "
        "planner measures activations on fake tensors: make training_step run without a Trainer on (input ids, "
        "targets) or {input_ids, attention_mask, labels} batches.",
    )


def module_max_seq_len(module: Any) -> int | None:
    """The longest sequence a module says it takes: a Hugging Face config's ``max_position_embeddings`` (or
    ``n_positions``), else a ``max_seq_len`` attribute or hyperparameter; ``None`` when it says nothing."""
    hf_config = getattr(module, "hf_config", None)
    for value in (
        getattr(hf_config, "max_position_embeddings", None),
        getattr(hf_config, "n_positions", None),
        getattr(module, "max_seq_len", None),
        getattr(getattr(module, "hparams", {}), "get", lambda _k: None)("max_seq_len"),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
