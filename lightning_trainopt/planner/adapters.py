"""Per-rank bytes of a model trained through adapters: the frozen base (whole precision or NF4 with its scales) apart
from the LoRA adapters, their gradients and optimizer states; and the FLOPs a frozen base saves.

Read from the implementations (bitsandbytes 0.50, peft 0.21, torch 2.13, deepspeed 0.19):

- NF4 (``bitsandbytes.functional.quantize_4bit`` and its fake kernel in ``bitsandbytes/_ops.py``): a weight of ``n``
  elements packs two 4-bit codes per byte into ``(n + 1) // (2 s)`` elements of the storage dtype of ``s`` bytes
  (``quant_storage``: ``uint8``, or ``bfloat16`` so that FSDP2 can shard it), so ``~n / 2`` bytes; one fp32 ``absmax``
  per block of ``blocksize`` (64) elements and a 16-entry fp32 code table per weight. With double quantization
  (``compress_statistics``) the absmax are stored as uint8 codes of blockwise quantization over blocks of 256 (one fp32
  scale each, ``state2.absmax``), plus an fp32 ``offset`` (their mean) and the 256-entry fp32 dynamic map that codes
  them (a copy per weight: measured on a ``Params4bit``, 1 KiB each).
- LoRA (peft ``tuners/lora/layer.py``): each targeted ``Linear(in, out)`` gets ``lora_A`` ``(r, in)`` and ``lora_B``
  ``(out, r)``; peft upcasts them to fp32 when the base is half (``autocast_adapter_dtype=True``). Only they have
  ``requires_grad``, so only they get ``.grad`` and optimizer states. Their forward saves ``lora_A``'s output
  (``tokens x r``) for ``lora_B``'s backward, and, with ``dropout > 0``, the dropped input and its mask.
- Frozen weights: DDP buckets only parameters that require gradients; DeepSpeed ZeRO-1/2 flatten and partition only
  the optimizer's parameters, so a frozen base stays whole on every rank (in the engine's half dtype); ZeRO-3's
  ``zero.Init`` and FSDP2's ``fully_shard`` shard every parameter, frozen ones included. A 4-bit weight's quantization
  state is an attribute of the parameter, not a tensor FSDP2 shards: its scales stay whole on every rank.
- FLOPs: a frozen linear layer skips its weight-gradient GEMM (``2 x numel`` FLOPs per token of the usual
  ``6 x numel``); the adapters add ``6 x r x (in + out)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner.fsdp_units import FSDPUnits
from lightning_trainopt.planner.model_states import estimate_model_states, param_dtype_bytes
from lightning_trainopt.planner.optimizer_state import OptimizerStateModel
from lightning_trainopt.planner.strategy_layout import StrategyLayout
from lightning_trainopt.planner.terms import MemoryEstimate, Term
from lightning_trainopt.planner.terms import numel_text as _gb

__all__ = [
    "ADAPTER_KINDS",
    "GPT_BLOCK_LINEARS",
    "AdapterPlan",
    "adapter_activation_terms",
    "adapter_model_states",
    "adapter_summary",
    "dequantized_weight_term",
    "frozen_base_terms",
    "gpt_adapter_plan",
    "lora_activation_bytes",
    "nf4_bytes",
    "qlora_activations",
]

ADAPTER_KINDS = ("lora", "qlora")
#: bitsandbytes' 4-bit code table (16 fp32 values), one per quantized weight.
_NF4_CODE_BYTES = 16 * 4
#: The 256-entry fp32 dynamic map of double quantization, held by each weight's nested state.
_DYNAMIC_MAP_BYTES = 256 * 4
#: Blocks of absmax values quantized together by double quantization (``quantize_blockwise(..., blocksize=256)``).
_NESTED_BLOCK = 256


def nf4_bytes(numel: int, blocksize: int = 64, double_quant: bool = True, storage_bytes: int = 1) -> tuple[int, int]:
    """(packed 4-bit data, quantization state) bytes of one weight of ``numel`` elements, as bitsandbytes stores them.

    The state is the absmax (fp32, or under double quantization uint8 codes + one fp32 scale per 256 of them + an
    fp32 offset + the 256-entry dynamic map) and the weight's 16-entry code table.

    Args:
        numel: elements of the weight.
        blocksize: elements per absmax (bitsandbytes' default 64).
        double_quant: the absmax are quantized again (``bnb_4bit_use_double_quant``).
        storage_bytes: bytes of the storage dtype (``uint8`` 1, ``bfloat16`` 2).
    """
    data = (numel + 1) // (2 * storage_bytes) * storage_bytes
    blocks = math.ceil(numel / blocksize)
    state = blocks + 4 * math.ceil(blocks / _NESTED_BLOCK) + 4 + _DYNAMIC_MAP_BYTES if double_quant else 4 * blocks
    return data, state + _NF4_CODE_BYTES


@dataclass(frozen=True)
class AdapterPlan:
    """What an adapter changes in the model, as plain numbers (the app reads them from the model or its preset).

    Args:
        kind: ``lora`` (frozen base in the weights' own precision) or ``qlora`` (frozen linear layers in NF4).
        r: LoRA rank.
        targeted: ``(in_features, out_features)`` of each linear layer that gets an adapter.
        quantized: elements of each base weight stored in 4 bit (``qlora``: the targeted linear layers, which the
            adapter core converts to bitsandbytes' ``Linear4bit``); empty for ``lora``.
        frozen: elements of every other base parameter (embeddings, norms, the head; for ``lora`` every weight).
        frozen_linear_numel: elements of the frozen linear weights, whose weight-gradient GEMMs backward skips.
        dropout: ``lora_dropout``; above 0 each adapter saves its dropped input and mask.
        blocksize: NF4 absmax block (64).
        double_quant: ``bnb_4bit_use_double_quant``.
        quant_storage_bytes: bytes of ``bnb_4bit_quant_storage`` (bf16: 2, what FSDP2 needs; uint8: 1).

    Example::

        AdapterPlan("qlora", r=16, targeted=((4096, 4096),), quantized=(4096 * 4096,), frozen=(32000 * 4096,))
    """

    kind: str
    r: int
    targeted: tuple[tuple[int, int], ...]
    quantized: tuple[int, ...] = ()
    frozen: tuple[int, ...] = ()
    frozen_linear_numel: int = 0
    dropout: float = 0.0
    blocksize: int = 64
    double_quant: bool = True
    quant_storage_bytes: int = 2

    def __post_init__(self) -> None:
        if self.kind not in ADAPTER_KINDS:
            raise ConfigError("adapter.kind", self.kind, f"plan one of {', '.join(ADAPTER_KINDS)} (none: no adapter).")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError("adapter.r", self.r, "use a positive whole rank, e.g. 16.")
        if not self.targeted:
            raise ConfigError(
                "adapter.target_modules", "()", "name at least one linear layer of the model (e.g. [q_proj, v_proj])."
            )
        if self.kind == "lora" and self.quantized:
            raise ConfigError("adapter.kind", self.kind, "only qlora stores base weights in 4 bit; use adapter=qlora.")

    @property
    def adapter_numels(self) -> list[int]:
        """Elements of each adapter tensor: ``lora_A`` (``r x in``) and ``lora_B`` (``out x r``) per targeted layer."""
        return [n for i, o in self.targeted for n in (self.r * i, o * self.r)]

    @property
    def n_adapter(self) -> int:
        """Trainable parameters."""
        return sum(self.adapter_numels)

    @property
    def n_base(self) -> int:
        """Frozen base parameters (quantized and not)."""
        return sum(self.quantized) + sum(self.frozen)

    def nf4(self) -> tuple[int, int]:
        """(packed 4-bit bytes, quantization-state bytes) of the whole quantized base, on one rank unsharded."""
        parts = [nf4_bytes(n, self.blocksize, self.double_quant, self.quant_storage_bytes) for n in self.quantized]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def flops_delta(self, tokens: int) -> int:
        """FLOPs of one forward + backward of ``tokens`` tokens that the adapter adds (positive) or saves (negative)
        relative to training every weight: no weight gradients for the frozen linear layers, the adapters' own."""
        return tokens * (6 * self.n_adapter - 2 * self.frozen_linear_numel)


def adapter_summary(plan: AdapterPlan) -> dict[str, int | str]:
    """The adapter in a few numbers (the plan's JSON ``adapter`` and its header line)."""
    data, state = plan.nf4()
    return {
        "kind": plan.kind,
        "r": plan.r,
        "targeted_layers": len(plan.targeted),
        "trainable_params": plan.n_adapter,
        "frozen_params": plan.n_base,
        "nf4_params": sum(plan.quantized),
        "nf4_bytes": data,
        "nf4_state_bytes": state,
    }


def lora_activation_bytes(plan: AdapterPlan, tokens: int, compute_bytes: int) -> int:
    """Bytes the adapters save for backward per micro-batch of ``tokens``: ``lora_A``'s output for ``lora_B``, and
    with dropout the dropped input (compute dtype) and its boolean mask."""
    total = 0
    for i, _ in plan.targeted:
        total += tokens * plan.r * compute_bytes
        if plan.dropout > 0:
            total += tokens * i * (compute_bytes + 1)
    return total


def adapter_activation_terms(
    plan: AdapterPlan, extra: int, checkpointed: float, n_blocks: int, tensor_parallel: int = 1
) -> list[Term]:
    """The adapters' saved tensors (``extra`` bytes for the whole model, :func:`lora_activation_bytes`): those of the
    blocks that keep their activations, and, under checkpointing, one recomputed block's while its backward runs."""
    what = "adapters: saved lora_A outputs" + (" and dropped inputs" if plan.dropout > 0 else "")
    formula = f"{len(plan.targeted)} layers x tok x (r {plan.r}" + (" + (b + 1) x in)" if plan.dropout > 0 else ")")
    terms = [
        Term("activations", "device", what, int(extra * (1 - checkpointed)) // tensor_parallel, formula, "backward")
    ]
    if checkpointed and n_blocks:
        terms.append(
            Term(
                "other",
                "device",
                f"{what}: one recomputed block",
                extra // n_blocks // tensor_parallel,
                f"{formula} / {n_blocks} blocks",
                "backward",
            )
        )
    return terms


def dequantized_weight_term(plan: AdapterPlan, compute_bytes: int, tensor_parallel: int = 1) -> Term:
    """bitsandbytes' 4-bit matmul dequantizes the whole weight to the compute dtype for each product (forward and
    input gradient) and frees it after: one such copy of the largest quantized layer at a time."""
    big = max(plan.quantized, default=0)
    return Term(
        "other",
        "device",
        "QLoRA: dequantized weight of the largest layer (during its matmul)",
        compute_bytes * big // tensor_parallel,
        f"{compute_bytes} B x {_gb(big)}",
        phase="backward",
    )


def _sharded(numels: Sequence[int], w: int) -> int:
    return sum(math.ceil(n / w) for n in numels)


def frozen_base_terms(
    plan: AdapterPlan,
    weight_bytes: int,
    layout: StrategyLayout,
    world_size: int,
    tensor_parallel: int = 1,
    largest_block: int = 0,
    root: int = 0,
) -> MemoryEstimate:
    """The frozen base on one rank: its weights (or 4-bit codes and their scales), where the strategy puts them.

    Args:
        plan: the adapter.
        weight_bytes: bytes per element of the unquantized frozen weights as the strategy stores them
            (``model_states.param_dtype_bytes``).
        layout: the strategy: ZeRO-3 and FSDP2 shard the base over ``world_size``; DDP and ZeRO-1/2 keep it whole;
            parameter offload puts it in host memory.
        world_size: ranks the model states are sharded over.
        tensor_parallel: TP degree: the base's matrices are split over it too (its vectors are few bytes).
        largest_block: elements of FSDP2's largest block unit, gathered (in the base's storage) while it computes.
        root: elements of FSDP2's root unit (embedding, final norm, head), gathered through backward.
    """
    w = world_size if layout.shards_params else 1
    where = "device" if layout.offload_params == "none" else layout.offload_params
    split = f" / {w}" if w > 1 else ""
    tp = f" / TP {tensor_parallel}" if tensor_parallel > 1 else ""
    wb = weight_bytes
    terms = [
        Term(
            "params",
            where,
            f"frozen base: {8 * wb}-bit weights",
            wb * _sharded(plan.frozen, w) // tensor_parallel,
            f"{wb} B x {_gb(sum(plan.frozen))}{split}{tp}",
        )
    ]
    if plan.quantized:
        n_q = sum(plan.quantized)
        s = plan.quant_storage_bytes
        # FSDP2 shards the packed storage tensor, ``((n + 1) // (2 s), 1)`` elements of the storage dtype, by rows.
        data = sum(math.ceil((n + 1) // (2 * s) / w) * s for n in plan.quantized) // tensor_parallel
        _, state = plan.nf4()
        dq = "1 B absmax (+ 4 B per 256 of them)" if plan.double_quant else "4 B absmax"
        terms.append(Term("params", where, "frozen base: NF4 4-bit weights", data, f"0.5 B x {_gb(n_q)}{split}{tp}"))
        terms.append(
            Term(
                "params",
                where,
                "frozen base: NF4 scales (whole on every rank)",
                state // tensor_parallel,
                f"{dq} per {plan.blocksize} of {_gb(n_q)}{tp}",
            )
        )
    if layout.shards_each_param and w > 1:
        # FSDP2 all-gathers a block's frozen weights (in their storage) while it computes, and the next one ahead.
        q_share = sum(plan.quantized) / max(plan.n_base, 1)
        per_elem = q_share * 0.5 + (1 - q_share) * wb
        gathered = int(per_elem * (2 * largest_block + root)) // tensor_parallel
        terms.append(
            Term(
                "other",
                "device",
                "FSDP2 frozen base gathered (2 blocks + root)",
                gathered,
                f"{per_elem:.2f} B x (2 x {_gb(largest_block)} + {_gb(root)})",
                phase="backward",
            )
        )
    return MemoryEstimate.of(terms)


def relabel_adapter_terms(states: MemoryEstimate) -> MemoryEstimate:
    """The model-state terms of the adapters, labelled as such (the frozen base has its own rows)."""
    return MemoryEstimate(tuple(replace(t, label=f"adapters: {t.label}") for t in states.terms))


def adapter_model_states(
    plan: AdapterPlan,
    trainer_precision: str,
    layout: StrategyLayout,
    optimizer: OptimizerStateModel,
    world_size: int,
    tensor_parallel: int = 1,
    accumulate: int = 1,
    adam_path: str = "fused",
    fsdp_units: FSDPUnits | None = None,
) -> MemoryEstimate:
    """Per-rank model states of an adapter run: the frozen base (:func:`frozen_base_terms`) and the adapters with
    their gradients and optimizer states (:func:`~lightning_trainopt.planner.model_states.estimate_model_states` of
    the adapter tensors alone), and what a rank holds while the model is built (the base as stored, plus the
    adapters).

    Args:
        plan: the adapter.
        trainer_precision: Lightning's precision string.
        layout: the strategy.
        optimizer: how the optimizer stores state (of the adapters only).
        world_size: ranks the model states are sharded over.
        tensor_parallel: TP degree.
        accumulate: gradient accumulation steps.
        adam_path: how torch Adam runs its step (``model_states.ADAM_PATHS``).
        fsdp_units: the base model's FSDP2 units, for the frozen weights gathered while a block computes.
    """
    wb, _ = param_dtype_bytes(trainer_precision, layout)
    # peft upcasts adapters to fp32 over a half base (autocast_adapter_dtype); DeepSpeed's engine casts them back.
    adapter_precision = (
        "32-true" if trainer_precision.endswith("-true") and not layout.wraps_in_engine else trainer_precision
    )
    adapters = estimate_model_states(
        [plan.adapter_numels],
        adapter_precision,
        layout,
        optimizer,
        world_size,
        accumulate=accumulate,
        adam_path=adam_path,
    )
    step = relabel_adapter_terms(MemoryEstimate(tuple(t for t in adapters.terms if t.phase != "build")))
    units = fsdp_units or FSDPUnits(blocks=())
    base = frozen_base_terms(plan, wb, layout, world_size, tensor_parallel, max(units.blocks, default=0), units.root)
    # Built: the base as it is stored (the app quantizes one layer at a time) and the adapters' weights.
    build = [replace(t, phase="build") for t in base.terms if t.category == "params"]
    build += [replace(t, phase="build") for t in step.terms if t.category == "params"]
    return base + step + MemoryEstimate.of(build)


def qlora_activations(acts: MemoryEstimate, plan: AdapterPlan, checkpointed: float) -> MemoryEstimate:
    """Activations under QLoRA: bitsandbytes' 4-bit matmul saves the packed weight, not autocast's half copy, so the
    half copies of the quantized weights in the base estimate (of the blocks that are not checkpointed) go."""
    if not plan.quantized:
        return acts
    dropped = int(2 * sum(plan.quantized) * (1 - checkpointed))
    out = []
    for t in acts.terms:
        if t.label.startswith("autocast half weight copies") and t.location == "device":
            t = replace(t, nbytes=max(0, t.nbytes - dropped), formula=f"{t.formula} - 2 B x NF4 weights")
        out.append(t)
    return MemoryEstimate.of(out)


#: The linear layers of one block of our GPT (``models/gpt.py``), by the names peft matches.
GPT_BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gpt_adapter_plan(
    cfg: GPTConfig,
    kind: str,
    r: int,
    target_modules: Sequence[str] | None = None,
    dropout: float = 0.0,
    double_quant: bool = True,
    quant_storage_bytes: int = 2,
) -> AdapterPlan:
    """The :class:`AdapterPlan` of our GPT preset ``cfg``: adapters on the block linear layers named in
    ``target_modules`` (``None``: all seven, the adapter core's default), under ``qlora`` those same layers in NF4
    (``transforms/adapters.py`` quantizes the targeted layers); the rest of the base frozen in its own precision.

    Raises:
        ConfigError: a target name that is not a linear layer of the model.
    """
    d, kv, f = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden
    shapes = {
        "q_proj": (d, cfg.n_heads * cfg.head_dim),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (cfg.n_heads * cfg.head_dim, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }
    names = tuple(target_modules) if target_modules is not None else GPT_BLOCK_LINEARS
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise ConfigError(
            "adapter.target_modules",
            list(names),
            f"{unknown} are not linear layers of {cfg.name}'s blocks; use names from {list(GPT_BLOCK_LINEARS)}.",
        )
    targeted = tuple(shapes[n] for n in names) * cfg.n_layers
    head = cfg.vocab_size * d
    embed = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    vectors = [d] * (2 * cfg.n_layers + 1)
    matrices = [i * o for i, o in shapes.values()] * cfg.n_layers
    quantized = tuple(i * o for i, o in targeted) if kind == "qlora" else ()
    kept = [i * o for n, (i, o) in shapes.items() if kind != "qlora" or n not in names] * cfg.n_layers
    frozen = (head, *([embed] if embed else []), *vectors, *kept)
    return AdapterPlan(
        kind,
        r,
        targeted,
        quantized,
        frozen,
        frozen_linear_numel=sum(matrices) + head,
        dropout=dropout,
        double_quant=double_quant,
        quant_storage_bytes=quant_storage_bytes,
    )
