"""What each strategy does with LoRA/QLoRA adapters (peft's LoRA layers: ``base_layer`` + ``lora_A``/``lora_B``).

The adapters are injected at step 1 of the ordered rewrite (``parallel/apply.py``); the strategies then meet a model
whose targeted linear layers are peft ``LoraLayer`` wrappers, the base frozen and only the adapters trainable. Which
strategy takes which adapter is the adapter rows of ``parallel/compat_table.py``; this module holds what the strategies
that take them must do differently (measured on 2 gloo ranks, torch 2.13, peft 0.21.2, bitsandbytes 0.50.2,
deepspeed 0.19.8):

* **Tensor parallelism** (:func:`adapter_tp_plan`): a plan names ``q_proj``, but the module there is peft's wrapper,
  which ``ColwiseParallel``/``RowwiseParallel`` refuse (they shard ``nn.Linear`` and ``nn.Embedding`` only). The base
  layer gets the base's style, and the two low-rank matrices the styles that keep the sum ``base(x) + B(A(x))`` in one
  layout (Megatron's LoRA): under a column-parallel base, ``A`` stays replicated (a plain tensor on each rank: its
  input is the whole activation and the gradient at its output is all-reduced by ``B``'s column-parallel input) and
  ``B`` is column-parallel (its output columns are the base's); under a row-parallel base, ``A`` is row-parallel
  (it reads the same feature shard as the base and its partial sums are reduced to the base's output layout) and
  ``B`` is replicated as a ``DTensor`` over the tensor-parallel ranks (sequence-parallel, like the norms: each rank
  multiplies its positions, and its weight gradient is the sum over the ranks).
* **DeepSpeed ZeRO-3** (:func:`restore_adapter_init`): ``configure_model`` runs inside ``zero.Init``, which
  partitions each new parameter as soon as its module is built, so peft's own initialisation (``lora_B`` zeros,
  ``lora_A`` Kaiming) writes into empty partitions and does nothing, and the owner's init that the strategy re-runs
  on leaving the context (``parallel/deepspeed.py``) then gives them its own: ``lora_B`` would not start at zero and
  the model would not start from the base's outputs (peft #2916). peft's init is re-run on the gathered adapters.
  The base's values then differ from an unsharded build of the same seed (the adapters' draws come between the
  base's construction and its re-run init); a pretrained base is read from its files and is the same.
* **FSDP2 with QLoRA** (:func:`prepare_4bit_for_fsdp2`): the 4-bit weights must be stored in a float type
  (``quant_storage``) for ``fully_shard`` to shard and all-gather them as plain storage; bitsandbytes restores each
  layer's quantisation state from the module after the all-gather (``Linear4bit.quant_state``, which is set here where
  the quantization did not set it: without it the first forward fails with "quant_state is required"). Its CPU path
  repacks a weight in place for inference (eval mode, no grad), which would rewrite the all-gathered storage FSDP2
  owns: it is turned off.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError

__all__ = [
    "adapter_layers",
    "adapter_tp_plan",
    "has_adapters",
    "prepare_4bit_for_fsdp2",
    "restore_adapter_init",
]

_FLOAT_STORAGE = (torch.bfloat16, torch.float16, torch.float32)


def _is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer: a wrapper with ``base_layer`` and the ``lora_A``/``lora_B`` dictionaries of adapters."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in ("base_layer", "lora_A", "lora_B"))


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, layer)`` of each peft LoRA layer of ``model`` (typed ``Any``: peft's layers are mixins whose
    attributes nn.Module's type does not declare)."""
    for name, module in model.named_modules():
        if _is_lora_layer(module):
            yield name, module


def has_adapters(model: nn.Module) -> bool:
    """``model`` holds at least one peft LoRA layer."""
    return next(adapter_layers(model), None) is not None


def adapter_tp_plan(layer: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (module name -> parallel style, relative to ``layer``) with each entry that names a peft LoRA layer
    replaced by entries for its base layer and its adapters (see the module docstring for why these styles).

    Raises:
        ConfigError: a LoRA layer under a style that is neither column- nor row-parallel.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    out: dict[str, Any] = {}
    for name, style in plan.items():
        module: Any = layer.get_submodule(name)
        if not _is_lora_layer(module):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        for adapter in module.lora_A:
            if isinstance(style, ColwiseParallel):
                # A replicated (left plain); B's column-parallel input all-reduces the gradient at A's output.
                out[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            elif isinstance(style, RowwiseParallel):
                (output,) = style.output_layouts
                out[f"{name}.lora_A.{adapter}"] = RowwiseParallel(
                    output_layouts=output, use_local_output=style.use_local_output
                )
                if isinstance(output, Shard):
                    # B reads A's output sharded over the sequence: a replicated DTensor weight, so its gradient is
                    # summed over the ranks' positions (as for the sequence-parallel norms).
                    out[f"{name}.lora_B.{adapter}"] = SequenceParallel(
                        sequence_dim=output.dim, use_local_output=style.use_local_output
                    )
                # Replicate output: B sees the whole activation on every rank and stays a plain replicated layer.
            else:
                raise ConfigError(
                    "adapter.target_modules",
                    name,
                    f"tensor parallelism shards {name} with {type(style).__name__}, which has no LoRA plan; "
                    "target column- or row-parallel linear layers only (q/k/v/o, gate/up/down).",
                )
    return out


def restore_adapter_init(model: nn.Module, existing: set[int] | frozenset[int] = frozenset()) -> int:
    """Re-run peft's initialisation of the LoRA adapters of ``model`` on their whole parameters (ZeRO-3 partitions
    gathered, rank 0 writing and the others receiving its values), as peft would have on an unpartitioned model.

    Args:
        model: the model (or LightningModule) holding peft LoRA layers.
        existing: ``id()`` of parameters that existed before the model was built: an adapter holding one is left as
            it is (Lightning enters ZeRO-3's context again for ``validate``/``test`` after ``fit``, with the adapters
            trained). A checkpoint loaded after this call overwrites the values, as it should.

    Returns:
        the number of LoRA layers re-initialised.
    """
    import deepspeed

    count = 0
    for _, layer in adapter_layers(model):
        params = [p for d in (layer.lora_A, layer.lora_B) for p in d.parameters()]
        if any(id(p) in existing for p in params):
            continue
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            for adapter in layer.lora_A:
                # peft's default init (B zeros, A Kaiming), the one transforms/adapters.py asks for.
                layer.reset_lora_parameters(adapter, True)
        count += 1
    return count


def prepare_4bit_for_fsdp2(model: nn.Module) -> int:
    """Check that every bitsandbytes 4-bit weight of ``model`` is stored in a float type, keep each layer's
    quantization state on the layer for after FSDP2's all-gather, and turn off bitsandbytes' in-place CPU repacking of
    the weights FSDP2 all-gathers (see the module docstring).

    Returns:
        the number of 4-bit layers.

    Raises:
        ConfigError: a 4-bit weight stored in an integer type (``adapter.quant_storage``), which FSDP2 cannot shard
            as the float storage it all-gathers.
    """
    count = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or type(weight).__name__ != "Params4bit":
            continue
        storage = weight.dtype
        if storage not in _FLOAT_STORAGE:
            raise ConfigError(
                "adapter.quant_storage",
                str(storage).removeprefix("torch."),
                f"FSDP2 shards and all-gathers the 4-bit weights as plain float storage, and {name} stores them as "
                f"{storage}; use adapter.quant_storage=bfloat16 (the qlora preset's default).",
            )
        if getattr(module, "quant_state", None) is None:
            # Where bitsandbytes looks for the quantization state once FSDP2's all-gather has handed the layer a
            # plain tensor (it is set there only when the weight was quantized with ``module=`` given).
            module.quant_state = weight.quant_state
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        count += 1
    return count
