"""What a rank holds while the model is built and handed to its strategy, before the first step (``build`` terms).

Read for the demo model as ``train.py`` builds it (lightning 2.6, deepspeed 0.19, torch 2.13): Lightning calls
``LitGPT.configure_model`` inside the strategy's ``tensor_init_context`` and ``model_sharded_context``.

- DDP / one device: the tensors are created on the device, in the half dtype for ``*-true`` (Lightning's precision
  context), else fp32: the weights the step keeps, nothing more.
- DeepSpeed ZeRO-1/2: ``configure_model`` builds in the engine's dtype (bf16/fp16 for ``-mixed`` too, since the
  engine casts to it), so the whole model in that dtype on every rank. DeepSpeed then flattens each param group on the
  device only when ``available_memory()`` has room for a second copy, else through the CPU: it never adds a device
  peak. (Built in fp32 it would hold 4 B/param: LLaMA-13B 48.5 GiB on a 40 GB card planned at 26.7 GiB.)
- DeepSpeed ZeRO-3: ``deepspeed.zero.Init`` partitions each parameter as its module is built; then
  ``parallel/deepspeed.py`` re-runs the model's init (``_rerun_custom_init``) one module at a time inside
  ``GatheredParameters``: at most one block or the embedding gathered at once, beside the partitions.
- FSDP2: ``TrainOptFSDPStrategy`` builds our GPT on the meta device, ``fully_shard``s it there and then gives each
  rank storage for its own shards only (on the device, or in host memory under ``CPUOffloadPolicy``), replaying the
  model's init one parameter at a time into a whole temporary in host memory (``parallel/meta_init.py``): the host
  holds one whole parameter (the embedding) at a time, never the model. (Before, the whole model was built in host
  memory on every rank: ``bench/fsdp_build_memory.py`` measured gpt_350m on 2 ranks at 1.14 x its fp32 bytes per
  rank, now 0.52 x, of which 0.5 x are the rank's shards.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_trainopt.planner.strategy_layout import StrategyLayout
from lightning_trainopt.planner.terms import Term
from lightning_trainopt.planner.terms import numel_text as _gb

__all__ = ["build_terms"]


def build_terms(
    numels: Sequence[int],
    weight_bytes: int,
    layout: StrategyLayout,
    world_size: int,
    largest_unit: int = 0,
    largest_gather: int | None = None,
) -> list[Term]:
    """The ``build`` terms of one rank.

    Args:
        numels: element counts of the model's parameters (each shared parameter once).
        weight_bytes: bytes per element of the weights as built (``model_states.param_dtype_bytes``).
        layout: the strategy.
        world_size: data-parallel ranks.
        largest_unit: elements of FSDP2's largest unit (unused since FSDP2 builds on the meta device; kept for
            callers).
        largest_gather: elements ZeRO-3 gathers at once to re-run the model's init: its largest block or single
            parameter (the embedding); default: the largest parameter.
    """
    n, b, w = sum(numels), weight_bytes, world_size
    whole = f"{b} B x {_gb(n)}"
    if not layout.shards_optimizer:
        return [Term("params", "device", f"{8 * b}-bit weights as built", b * n, whole, phase="build")]
    if not layout.shards_params:
        return [
            Term(
                "params",
                "device",
                f"{8 * b}-bit weights as built, before DeepSpeed flattens them",
                b * n,
                whole,
                "build",
            )
        ]
    shards = sum(math.ceil(k / w) for k in numels)
    if layout.flat_partitions:
        gather = min(max(numels, default=0) if largest_gather is None else largest_gather, n)
        terms = [
            Term(
                "params",
                "device",
                "the largest block or embedding, gathered to re-run the model's init (zero.Init)",
                b * gather,
                f"{b} B x {_gb(gather)} (parallel/deepspeed.py _rerun_custom_init)",
                phase="build",
            )
        ]
        if layout.offload_params == "none":
            terms.append(Term("params", "device", "weight partitions", b * shards, f"{whole} / {w}", phase="build"))
        return terms
    largest = max(numels, default=0)
    temporary = Term(
        "params",
        "cpu",
        "one whole parameter at a time, drawn to initialise its shards (meta-device build)",
        b * largest,
        f"{b} B x {_gb(largest)} (parallel/meta_init.py)",
        phase="build",
    )
    place = "device" if layout.offload_params == "none" else "cpu"  # CPUOffloadPolicy keeps the shards on the host
    return [temporary, Term("params", place, "this rank's shards", b * shards, f"{whole} / {w}", phase="build")]
