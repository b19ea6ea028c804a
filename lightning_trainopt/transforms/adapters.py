"""LoRA and QLoRA adapters: low-rank trainable matrices added to a frozen base, through peft.

:func:`apply_adapter` rewrites a model in place (step 1, ``convert``, of the ordered rewrite in
``parallel/apply.py``): with ``kind="qlora"`` the targeted linear layers' weights are first quantized to 4-bit NF4
by bitsandbytes (``Linear4bit``, double quantization, the packed weight stored in ``quant_storage`` = bf16 so that a
sharding strategy sees an ordinary float tensor); then peft's ``inject_adapter_in_model`` wraps each targeted layer
in a LoRA layer (``base_layer`` + ``lora_A``/``lora_B``) and freezes everything else.

Why ``inject_adapter_in_model`` and not ``get_peft_model``: the latter wraps the model in a ``PeftModel`` whose
parameter names gain a ``base_model.model.`` prefix and whose ``forward`` takes other arguments; a user's
LightningModule calls its inner model as before, so the adapter is injected into that model in place and the only
new names are peft's (``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``).

Example::

    report = apply_adapter(lit_module, AdapterSpec(kind="lora", r=16, alpha=32))
    report.trainable, report.frozen            # parameters that train / that stay as they were
    adapter_state_dict(lit_module)             # only the LoRA tensors
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_trainopt.exceptions import ConfigError, MissingDependencyError

__all__ = [
    "AdapterReport",
    "AdapterSpec",
    "adapter_state_dict",
    "apply_adapter",
    "base_state_hash",
    "check_targets",
    "default_target_modules",
    "describe",
    "frozen_base_names",
    "inner_model",
    "is_adapter_model",
]

#: LLaMA-style projection names: our GPT presets and Hugging Face Llama, Mistral and Qwen2.
_LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: GPT-2's ``Conv1D`` layers (weights stored transposed: peft sets ``fan_in_fan_out`` for them).
_GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
#: Hugging Face ``config.model_type`` -> default targets.
_HF_TARGETS = {"llama": _LLAMA_TARGETS, "mistral": _LLAMA_TARGETS, "qwen2": _LLAMA_TARGETS, "gpt2": _GPT2_TARGETS}
_OUR_GPT_MODULE = "lightning_trainopt.models.gpt"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_KINDS = ("none", "lora", "qlora")
_QUANT_TYPES = ("nf4", "fp4")


@dataclass(frozen=True)
class AdapterSpec:
    """The ``adapter`` group (``conf/adapter/{none,lora,qlora}.yaml``).

    Args:
        kind: ``none`` (full fine-tuning), ``lora`` or ``qlora`` (the base's targeted layers in 4 bits).
        r: LoRA rank.
        alpha: LoRA scaling numerator (the update is scaled by ``alpha / r``).
        dropout: dropout on the LoRA branch's input.
        target_modules: module names (or name suffixes) to adapt; ``None``: the defaults of the architecture
            (:func:`default_target_modules`).
        quant_type: QLoRA's 4-bit type, ``nf4`` (the QLoRA paper's) or ``fp4``.
        double_quant: QLoRA quantizes the per-block scales too (about 0.37 bits per weight saved).
        compute_dtype: the dtype QLoRA dequantizes to for the matmul (``bfloat16``, ``float16``, ``float32``).
        quant_storage: the dtype the packed 4-bit weight is stored as (``bfloat16``: what FSDP2 shards like any other
            bf16 parameter, and what a ``bf16-true`` cast leaves untouched).

    Raises:
        ConfigError: a value out of range, naming the ``adapter.*`` key and the fix.
    """

    kind: Literal["none", "lora", "qlora"] = "none"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    quant_storage: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError("adapter.kind", self.kind, f"use one of {', '.join(_KINDS)} (adapter=lora, ...).")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ConfigError("adapter.r", self.r, "use a positive whole rank, e.g. adapter.r=16.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ConfigError("adapter.alpha", self.alpha, "use a positive scale, e.g. adapter.alpha=32 (2 x r).")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError("adapter.dropout", self.dropout, "use a probability in [0, 1), e.g. 0.05.")
        if self.target_modules is not None:
            targets = self.target_modules
            if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets) or not targets:
                raise ConfigError(
                    "adapter.target_modules", targets, "give a list of module names, e.g. [q_proj,v_proj], or null."
                )
            object.__setattr__(self, "target_modules", tuple(targets))
        if self.quant_type not in _QUANT_TYPES:
            raise ConfigError("adapter.quant_type", self.quant_type, f"use one of {', '.join(_QUANT_TYPES)}.")
        for key in ("compute_dtype", "quant_storage"):
            if getattr(self, key) not in _DTYPES:
                raise ConfigError(f"adapter.{key}", getattr(self, key), f"use one of {', '.join(_DTYPES)}.")

    @property
    def enabled(self) -> bool:
        """An adapter is applied (``kind`` is not ``none``)."""
        return self.kind in ("lora", "qlora")


@dataclass
class AdapterReport:
    """What :func:`apply_adapter` did.

    Args:
        kind: the spec's kind.
        targets: the target names used (the spec's or the architecture's defaults).
        adapted: the full names of the modules that got a LoRA branch.
        quantized: the full names of the linear layers stored in 4 bits (QLoRA).
        trainable: parameters that require grad afterwards (the adapters).
        frozen: parameters that do not (the base).
    """

    kind: str
    targets: tuple[str, ...]
    adapted: list[str] = field(default_factory=list)
    quantized: list[str] = field(default_factory=list)
    trainable: int = 0
    frozen: int = 0


def inner_model(model: nn.Module) -> nn.Module:
    """The model a LightningModule wraps (its ``model`` attribute, as our modules and most users' keep it), else
    ``model`` itself."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else model


def default_target_modules(model: nn.Module) -> tuple[str, ...]:
    """The modules LoRA adapts by default: every linear layer of the attention and the MLP.

    Our GPT presets and Hugging Face Llama/Mistral/Qwen2 name them ``q/k/v/o_proj`` and ``gate/up/down_proj``;
    GPT-2 ``c_attn``, ``c_proj``, ``c_fc``. The output head and the embeddings are never adapted by default.

    Raises:
        ConfigError: an architecture without defaults (key ``adapter.target_modules``), listing its linear layers.
    """
    inner = inner_model(model)
    # Our presets by module path: models/ sits above transforms/ and may not be imported from here.
    if type(inner).__module__ == _OUR_GPT_MODULE:
        return _LLAMA_TARGETS
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type in _HF_TARGETS:
        return _HF_TARGETS[model_type]
    names = sorted({name.rsplit(".", 1)[-1] for name, _ in _linear_modules(inner)})
    raise ConfigError(
        "adapter.target_modules",
        None,
        f"no default targets for {type(inner).__name__}; name the layers to adapt among its linear layers "
        f"{names}, e.g. adapter.target_modules=[{','.join(names[:2])}].",
    )


def apply_adapter(model: nn.Module, spec: AdapterSpec) -> AdapterReport:
    """Add LoRA adapters to ``model`` (a LightningModule or the model itself) in place, QLoRA's 4-bit base first.

    Afterwards only the adapters' parameters require grad. Idempotent: a model that already has adapters is left as
    it is (Lightning calls ``configure_model`` again for ``validate``/``test`` after ``fit``).

    Raises:
        ConfigError: a target name that matches no module (naming ``adapter.target_modules`` and the model's linear
            layers), a model on the meta device with ``qlora``, or an architecture without default targets.
        MissingDependencyError: peft (or, for QLoRA, bitsandbytes) is not installed.
    """
    inner = inner_model(model)
    if not spec.enabled:
        return AdapterReport(kind=spec.kind, targets=())
    if is_adapter_model(inner):
        return _count(AdapterReport(kind=spec.kind, targets=spec.target_modules or ()), model)
    targets = check_targets(model, spec)
    report = AdapterReport(kind=spec.kind, targets=targets)
    if spec.kind == "qlora":
        report.quantized = _quantize_4bit(inner, targets, spec)
    _inject_lora(inner, targets, spec)
    # peft freezes the base, except where it keeps a Hugging Face model's output head trainable when the config
    # asks to tie it to untied embeddings (a tiny Llama built from its config): freeze all but the adapters here.
    prefixes = _adapter_prefixes(model)
    for name, param in model.named_parameters():
        if not any(name.startswith(p) for p in prefixes):
            param.requires_grad_(False)
        elif param.dtype in (torch.bfloat16, torch.float16):
            # peft creates the adapters in the base layer's dtype (QLoRA's bf16 storage); they train in fp32, as
            # get_peft_model's autocast_adapter_dtype does (a bf16-true run casts the whole module afterwards).
            param.data = param.data.float()
    report.adapted = [name for name, module in inner.named_modules() if _is_lora_layer(module)]
    return _count(report, model)


def check_targets(model: nn.Module, spec: AdapterSpec) -> tuple[str, ...]:
    """The target names ``spec`` adapts on ``model`` (its own, else the architecture's defaults), each checked to
    match a linear layer. Works on a model built on the meta device, so pre-flight can call it before any process
    starts.

    Raises:
        ConfigError: an architecture without defaults, or a target that matches no linear layer (both naming
            ``adapter.target_modules`` and listing the model's linear layers).
    """
    inner = inner_model(model)
    targets = spec.target_modules or default_target_modules(model)
    matched = [name for name, _ in _target_layers(inner, targets)]
    missing = [t for t in targets if not any(_matches(name, t) for name in matched)]
    if missing:
        names = sorted({name.rsplit(".", 1)[-1] for name, _ in _linear_modules(inner)})
        raise ConfigError(
            "adapter.target_modules",
            list(targets),
            f"{missing} match no linear layer of {type(inner).__name__}; pick among {names}.",
        )
    return targets


def is_adapter_model(model: nn.Module) -> bool:
    """``model`` (or the model it wraps) holds peft LoRA layers."""
    return any(_is_lora_layer(m) for m in model.modules())


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors of ``model``'s state dict (names as in ``model.state_dict()``)."""
    names = _adapter_prefixes(model)
    return {k: v for k, v in model.state_dict().items() if any(k.startswith(p) for p in names)}


def frozen_base_names(model: nn.Module) -> list[str]:
    """The keys of ``model.state_dict()`` that are not adapter tensors: the frozen base (4-bit weights with their
    quantization state under QLoRA)."""
    names = _adapter_prefixes(model)
    return [k for k in model.state_dict() if not any(k.startswith(p) for p in names)]


def base_state_hash(model: nn.Module) -> str:
    """SHA-256 of the frozen base's tensors (names, dtypes, shapes and bytes, in key order): equal for two bases
    that hold the same weights, so a resume can tell that the base it rebuilt is the one the adapter was trained on."""
    digest = hashlib.sha256()
    state = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head's key too
    sharded = False
    for key in sorted(frozen_base_names(model)):
        value = state[key]
        digest.update(key.encode())
        zero3_shape = getattr(params.get(key), "ds_shape", None)
        if zero3_shape is not None:
            # A ZeRO-3 parameter: its name, dtype and whole shape only. DeepSpeed's checkpoint holds the frozen
            # partitions and loads them itself (DeepSpeed #3090, fixed in 0.19.8), so no rebuilt base replaces them;
            # and the bytes a rank sees differ between the save (an empty placeholder) and a resume's load hook.
            digest.update(f"zero3{value.dtype}{tuple(zero3_shape)}".encode())
            continue
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            if hasattr(tensor, "to_local"):  # FSDP2/TP: this rank's shard (the whole would be gathered on every rank)
                tensor, sharded = tensor.to_local(), True
            tensor = tensor.to("cpu").contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    if sharded and torch.distributed.is_initialized():
        # Every rank hashes its shards; the base's hash is that of all ranks' hashes, the same on every rank (the
        # checkpoint hooks that call this run on every rank).
        ranks: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, digest.hexdigest())
        return hashlib.sha256("".join(ranks).encode()).hexdigest()
    return digest.hexdigest()


def _adapter_prefixes(model: nn.Module) -> list[str]:
    """``name.lora_`` for every LoRA layer of ``model``: where its adapter tensors live."""
    return [f"{name}.lora_" if name else "lora_" for name, m in model.named_modules() if _is_lora_layer(m)]


def _count(report: AdapterReport, model: nn.Module) -> AdapterReport:
    report.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report.frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return report


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def _matches(name: str, target: str) -> bool:
    """peft's rule for a string target: the full name, or its end at a ``.`` boundary."""
    return name == target or name.endswith("." + target)


def _is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` (bitsandbytes' ``Linear4bit`` is one) or transformers' ``Conv1D`` (GPT-2)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((name, m) for name, m in model.named_modules() if name and _is_linear(m))


def _target_layers(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in _linear_modules(model) if any(_matches(name, t) for t in targets)]


def _inject_lora(model: nn.Module, targets: tuple[str, ...], spec: AdapterSpec) -> None:
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:  # pragma: no cover - peft is in the cpu extra
        raise MissingDependencyError("peft", "peft", "adapter=lora") from err
    conv1d = any(type(m).__name__ == "Conv1D" for _, m in _target_layers(model, targets))
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft annotates int; it divides by r, a float works
        lora_dropout=spec.dropout,
        target_modules=list(targets),
        bias="none",
        fan_in_fan_out=conv1d,
    )
    # peft picks its bitsandbytes LoRA layer only when the model says it was loaded in 4 bits (transformers' flag).
    # Set just for the injection: transformers refuses dtype casts of a model that carries it.
    quantized = spec.kind == "qlora"
    if quantized:
        model.__dict__["is_loaded_in_4bit"] = True
    try:
        inject_adapter_in_model(config, model)
    finally:
        if quantized:
            model.__dict__.pop("is_loaded_in_4bit", None)


def _quantize_4bit(model: nn.Module, targets: tuple[str, ...], spec: AdapterSpec) -> list[str]:
    """Replace each targeted linear layer by a bitsandbytes ``Linear4bit`` holding its weight in 4 bits, in place."""
    try:
        import bitsandbytes as bnb
    except ImportError as err:  # pragma: no cover - bitsandbytes is in the cpu extra
        raise MissingDependencyError("bitsandbytes", "bnb", "adapter=qlora") from err
    quantized = []
    for name, layer in _target_layers(model, targets):
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        if weight.is_meta:
            raise ConfigError(
                "adapter.kind",
                "qlora",
                "the model was built on the meta device (FSDP2/TP), where there are no weights to quantize yet; "
                "use adapter=lora with that strategy, or a strategy that builds the model whole.",
            )
        # Conv1D stores (in, out); Linear4bit wants nn.Linear's (out, in).
        data = weight.detach().t() if type(layer).__name__ == "Conv1D" else weight.detach()
        out_features, in_features = data.shape
        bias = getattr(layer, "bias", None)
        new = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=bias is not None,
            compute_dtype=_DTYPES[spec.compute_dtype],
            compress_statistics=spec.double_quant,
            quant_type=spec.quant_type,
            quant_storage=_DTYPES[spec.quant_storage],
            device="meta",
        )
        new.weight = bnb.nn.Params4bit(
            data.contiguous(),
            requires_grad=False,
            compress_statistics=spec.double_quant,
            quant_type=spec.quant_type,
            quant_storage=_DTYPES[spec.quant_storage],
        )
        if bias is not None:
            # In the compute dtype: bitsandbytes' forward casts the bias to it in place at the first call, which
            # changed the frozen base after its hash was taken, so a GPT-2/Qwen2 (biased) QLoRA run could be neither
            # resumed nor exported ("SHA-256 differs"). Stored so from the start, the rebuilt base is the trained one.
            bias_data = bias.detach().to(_DTYPES[spec.compute_dtype]).clone()
            new.bias = nn.Parameter(bias_data, requires_grad=False)
        # Off: in eval on an AVX512-BF16 CPU, bitsandbytes repacks the weight and its quantization state in place for
        # its CPU kernel (and back when the state dict is read, not bit for bit), so a validation pass would change
        # the frozen base that a resume checks by hash (that kernel also fails on layers narrower than 64 inputs).
        new.support_avx512bf16_for_cpu = False
        # Moving a Params4bit to a real device is what quantizes it (bitsandbytes' rule; it runs on CPU too).
        new = new.to(weight.device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        quantized.append(name)
    return quantized


def describe(spec: AdapterSpec) -> dict[str, Any]:
    """The spec as plain values (what a checkpoint records)."""
    values = asdict(spec)
    values["target_modules"] = list(spec.target_modules) if spec.target_modules else None
    return values
