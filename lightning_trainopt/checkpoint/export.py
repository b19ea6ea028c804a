"""Export a fine-tuned checkpoint: its LoRA/QLoRA adapter merged into the base, or the adapter alone.

Console script: ``trainopt-export CHECKPOINT --out DIR [--format state_dict|peft|hf] [--dtype ...]``.

``CHECKPOINT`` is a Lightning ``.ckpt`` file, a DeepSpeed ZeRO checkpoint directory, a DCP directory (FSDP2/TP) or a
run folder (its newest complete checkpoint under ``checkpoints/``). The sharded forms are gathered on one process as
``trainopt-convert`` gathers them, whatever the number of ranks that wrote them, and the frozen base an adapter run
left out of its checkpoint is rebuilt and checked by its recorded hash
(:mod:`~lightning_trainopt.checkpoint.export_source`). Three outputs:

- ``state_dict``: ``DIR/state_dict.pt``, the merged model's plain state dict (``torch.load`` + ``load_state_dict``
  into the model without adapters); no ``lora_`` tensor is left in it.
- ``peft``: ``DIR/adapter_model.safetensors`` + ``DIR/adapter_config.json``, the adapter alone, which
  ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the base model.
- ``hf``: a Hugging Face model directory of the merged model (``AutoModelForCausalLM.from_pretrained``): a
  ``model=hf`` run's own architecture, our GPT presets as ``LlamaForCausalLM``
  (:func:`~lightning_trainopt.checkpoint.hf_export.gpt_to_llama`).

The merge is peft's own (``LoraModel.merge_and_unload``: W + scaling * B @ A) on the model rebuilt from the
checkpoint's hyper-parameters; only a checkpoint of another LightningModule (no model to rebuild) is merged tensor by
tensor with the same formula. A QLoRA base (bitsandbytes NF4/FP4) is dequantized first, so the merged weights are the
dequantized base plus the adapter's delta, not the weights before quantization (a warning says so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_trainopt.checkpoint.convert import _reference_model, _restore_tied
from lightning_trainopt.checkpoint.export_source import (
    PEFT_PREFIX,
    read_checkpoint,
    recorded_adapter,
    resolve_checkpoint,
)
from lightning_trainopt.checkpoint.files import write_directory_atomic
from lightning_trainopt.exceptions import CheckpointWriteError, ConfigError, ExportWriteError, TrainOptError

__all__ = ["DTYPES", "FORMATS", "ExportReport", "dequantize_4bit_state", "export_checkpoint", "main", "merge_lora"]

FORMATS = ("state_dict", "peft", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# peft's names: <module>.lora_A.<adapter>.weight; a get_peft_model wrapper adds base_model.model. in front.
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)\.(?P<adapter>[^.]+)\.weight$")
# bitsandbytes' Linear4bit saves its packed weight and, next to it, the quantization state under weight.<part>.
_QUANT_STATE = re.compile(r"^(?P<weight>.+)\.quant_state\.bitsandbytes__(nf4|fp4)$")
_UNSUPPORTED = ("lora_embedding_", "lora_magnitude_vector")


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        checkpoint: the checkpoint read (a run folder's newest complete one).
        format: ``state_dict``, ``peft`` or ``hf``.
        out: the directory written.
        adapted_modules: modules that had an adapter (merged, or written alone for ``peft``).
        dequantized: 4-bit base weights that were dequantized before the merge.
        dtype: the floating dtype of the weights written.
        tensors: tensors written.
    """

    checkpoint: Path
    format: str
    out: Path
    adapted_modules: int
    dequantized: int
    dtype: torch.dtype
    tensors: int


def dequantize_4bit_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` with every bitsandbytes 4-bit weight (its packed tensor and ``weight.<part>`` quantization state)
    replaced by the dequantized float32 weight (``nn.Linear``'s (out, in) layout); and the keys dequantized.

    Raises:
        MissingDependencyError: a 4-bit weight and bitsandbytes is not installed.
    """
    found = [m.group("weight") for key in state if (m := _QUANT_STATE.match(key))]
    if not found:
        return state, []
    from lightning_trainopt.exceptions import MissingDependencyError

    try:
        from bitsandbytes.functional import QuantState, dequantize_4bit
    except ImportError as err:
        raise MissingDependencyError("bitsandbytes", "bnb", "exporting a QLoRA checkpoint's 4-bit base") from err
    out = dict(state)
    for weight in found:
        parts = {k[len(weight) + 1 :]: out.pop(k) for k in list(out) if k.startswith(weight + ".")}
        quant_state = QuantState.from_dict(parts, device=torch.device("cpu"))
        # quant_storage (bf16 so that FSDP2 can shard it) only re-types the packed bytes.
        packed = out[weight].contiguous().view(torch.uint8).reshape(-1, 1)
        out[weight] = dequantize_4bit(packed, quant_state).float()
    return out, found


def _to_model_layout(
    state: dict[str, torch.Tensor], model: torch.nn.Module, keys: list[str]
) -> dict[str, torch.Tensor]:
    """Dequantized weights of GPT-2's ``Conv1D`` layers transposed back to its (in, out) layout: QLoRA stored them
    in a ``Linear4bit``, which holds ``nn.Linear``'s (out, in)."""
    out = dict(state)
    for key in keys:
        owner = key.replace(".base_layer.", ".").rsplit(".", 1)[0]
        if type(model.get_submodule(owner)).__name__ == "Conv1D":
            out[key] = out[key].t().contiguous()
    return out


def _split_adapter(state: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], str | None]:
    """``{module: (lora_A, lora_B)}`` of the checkpoint's LoRA adapter and its name (``None``: no adapter).

    Raises:
        ConfigError: several adapters, an A without its B, or a LoRA form the merge does not cover.
    """
    unsupported = sorted({k for k in state for mark in _UNSUPPORTED if mark in k})
    if unsupported:
        raise ConfigError(
            "checkpoint",
            unsupported[0],
            "an embedding LoRA or DoRA adapter, which trainopt-export does not merge; export it with peft "
            "(PeftModel.merge_and_unload) or train with adapter targets that are linear layers, without DoRA.",
        )
    parts: dict[str, dict[str, torch.Tensor]] = {}
    names = set()
    for key, tensor in state.items():
        if m := _LORA.match(key):
            parts.setdefault(m.group("module"), {})[m.group("ab")] = tensor
            names.add(m.group("adapter"))
    if len(names) > 1:
        raise ConfigError("checkpoint", sorted(names), "holds several adapters; export a checkpoint with one.")
    pairs = {}
    for module, ab in parts.items():
        if ab.keys() != {"A", "B"}:
            raise ConfigError(
                "checkpoint", module, "has lora_A or lora_B without the other: the checkpoint is damaged."
            )
        pairs[module] = (ab["A"], ab["B"])
    return pairs, (names.pop() if names else None)


def _lora_settings(recorded: dict[str, Any], lora_alpha: float | None) -> tuple[float, float, bool]:
    """``(alpha, dropout, use_rslora)`` of the adapter: recorded, or ``lora_alpha`` given on the command line.

    Raises:
        ConfigError: alpha neither recorded nor given, or given unlike the recorded one.
    """
    alpha = recorded.get("alpha", recorded.get("lora_alpha"))
    if isinstance(alpha, str):  # an unresolved interpolation in .hydra/config.yaml: not a value to trust
        alpha = None
    if alpha is None:
        if lora_alpha is None:
            raise ConfigError(
                "--lora-alpha",
                None,
                "the checkpoint and its run folder record no adapter alpha (the merge scales B @ A by alpha / r); "
                "give --lora-alpha with the adapter.alpha the run trained with.",
            )
        value = float(lora_alpha)
    elif lora_alpha is not None and float(alpha) != float(lora_alpha):
        raise ConfigError(
            "--lora-alpha",
            lora_alpha,
            f"the checkpoint records adapter alpha {alpha}; drop --lora-alpha, or give the recorded value.",
        )
    else:
        value = float(alpha)
    dropout = float(recorded.get("dropout", recorded.get("lora_dropout", 0.0)) or 0.0)
    return value, dropout, bool(recorded.get("use_rslora", False))


def _lora_config(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float, dropout: float, rslora: bool, task: str | None
) -> Any:
    """peft's ``LoraConfig`` of the adapter: ranks read off the tensors, targets the adapted modules by full name."""
    from peft import LoraConfig

    ranks = {module: int(a.shape[0]) for module, (a, _) in pairs.items()}
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    # peft annotates an int and writes 16, not 16.0, to adapter_config.json; it scales by any number.
    lora_alpha: Any = int(alpha) if alpha.is_integer() else alpha
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=dropout,
        use_rslora=rslora,
        target_modules=sorted(pairs),
        rank_pattern={f"^{re.escape(m)}$": k for m, k in ranks.items() if k != r},
        task_type=task,
    )


def merge_lora(
    state: dict[str, torch.Tensor],
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    config: Any,
    adapter: str,
    model: torch.nn.Module | None,
) -> dict[str, torch.Tensor]:
    """The merged model's state dict (fp32), keyed like the model without adapters.

    With ``model`` (the plain model on the meta device) peft merges: the adapter is injected as in training
    (``LoraModel``), the checkpoint's tensors assigned, ``merge_and_unload`` folds each B @ A into its base weight.
    Without one (a LightningModule we cannot rebuild), each ``base_layer.weight`` gets ``scaling * B @ A`` added,
    ``scaling`` = alpha / r (alpha / sqrt(r) with rsLoRA), peft's formula for a linear layer.

    Args:
        state: the checkpoint's tensors, 4-bit bases already dequantized.
        pairs: ``{module: (lora_A, lora_B)}`` (see :func:`_split_adapter`).
        config: the adapter's ``peft.LoraConfig``.
        adapter: the adapter's name in the checkpoint's keys (peft's ``default``).
        model: the plain model, or ``None``.
    """
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if model is None:
        merged = {k: v for k, v in state.items() if not _LORA.match(k)}
        for module, (a, b) in pairs.items():
            r = a.shape[0]
            scaling = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
            merged[f"{module}.base_layer.weight"] = merged[f"{module}.base_layer.weight"] + scaling * (b.float() @ a)
        return {k.replace(".base_layer.", "."): v for k, v in merged.items()}
    from peft.tuners.lora import LoraModel

    if any(type(m).__name__ == "Conv1D" for n, m in model.named_modules() if n in config.target_modules):
        config.fan_in_fan_out = True  # GPT-2's layers store (in, out); peft would set it itself, with a warning
    lora = LoraModel(model, config, adapter)
    _restore_tied(lora.model, state)
    shared = _shared_parameters(lora.model)
    lora.model.load_state_dict(state, strict=True, assign=True)
    # assign=True gives each name its own Parameter; tie them again (a tied head stays tied in the merged model).
    for first, *others in shared:
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(lora.model.get_submodule(owner), attr, lora.model.get_parameter(first))
    return dict(lora.merge_and_unload().state_dict())


def _shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules share (a tied output head and embedding)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _adapts_conv1d(shape: Any, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the adapted layers of the checkpoint's model are transformers' ``Conv1D`` (GPT-2); ``False`` when the
    model cannot be built here (its ``model.pretrained`` files gone): the adapter is written as before."""
    try:
        model = _reference_model(shape)
    except (ConfigError, OSError, ValueError):
        return False
    if model is None:
        return False
    modules = dict(model.named_modules())
    return any(type(modules.get(name)).__name__ == "Conv1D" for name in pairs)


def _write_peft(out: Path, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], config: Any, dtype: torch.dtype) -> int:
    """``adapter_model.safetensors`` + ``adapter_config.json`` as ``PeftModel.save_pretrained`` writes them."""
    from safetensors.torch import save_file

    tensors = {}
    for module, (a, b) in pairs.items():
        # get_peft_model_state_dict's names: the wrapper's prefix, the adapter's name dropped.
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.to(dtype).contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.to(dtype).contiguous()
    config.save_pretrained(os.fspath(out))
    save_file(tensors, os.fspath(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return len(tensors)


def _write_hf(
    out: Path, model: torch.nn.Module | None, shape: Any, merged: dict[str, torch.Tensor], dtype: Any
) -> None:
    """A Hugging Face model directory of ``merged``: the run's own architecture, or our GPT as Llama."""
    save = getattr(model, "save_pretrained", None)
    if callable(save):
        save(os.fspath(out), state_dict=merged)
    elif isinstance(shape, dict) and "d_model" in shape:
        from lightning_trainopt.checkpoint.hf_export import gpt_to_llama
        from lightning_trainopt.models import GPTConfig

        gpt_to_llama(merged, GPTConfig(**shape), out)
    else:
        raise ConfigError(
            "--format",
            "hf",
            "the checkpoint is neither of a model=hf run nor of a GPT preset, so it has no Hugging Face form; use "
            "--format state_dict or --format peft.",
        )
    # The dtype the tensors were written in (save_pretrained records the meta-built model's): from_pretrained's
    # default (dtype="auto") loads them as they are.
    config = out / "config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "dtype": str(dtype).removeprefix("torch.")}, indent=2)
    )


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    format: str = "hf",
    dtype: str = "auto",
    lora_alpha: float | None = None,
) -> ExportReport:
    """Merge the checkpoint's adapter into its base and write ``format`` to ``out`` (see the module's docstring).

    Args:
        checkpoint: a ``.ckpt`` file, a ZeRO or DCP checkpoint directory, or a run folder (its newest complete
            checkpoint).
        out: the directory to write; created, and refused when it already holds files.
        format: ``state_dict``, ``peft`` or ``hf``.
        dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto``: bfloat16 for a QLoRA checkpoint (its compute
            dtype), else the dtype the base was saved in.
        lora_alpha: the adapter's alpha, needed only when the run recorded none (checked against it otherwise).

    Raises:
        ConfigError: a missing, incomplete or unknown checkpoint; ``format=peft`` for a checkpoint without an
            adapter; ``hf`` for a model that has no Hugging Face form; an unknown format or dtype; a non-empty
            ``out``; an adapter alpha neither recorded nor given.
    """
    if format not in FORMATS:
        raise ConfigError("--format", format, f"use one of {', '.join(FORMATS)}.")
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError("--dtype", dtype, f"use auto or one of {', '.join(DTYPES)}.")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", os.fspath(out), "it already holds files; give a new or empty directory.")
    path = resolve_checkpoint(checkpoint)
    state, hyper = read_checkpoint(path, need_base=format != "peft")
    pairs, adapter = _split_adapter(state)
    if format == "peft" and adapter is None:
        raise ConfigError(
            "checkpoint",
            os.fspath(path),
            "holds no LoRA adapter (no lora_A/lora_B tensors), so there is no peft adapter to write; train with "
            "adapter=lora or adapter=qlora, or export the whole model with --format state_dict or hf.",
        )
    shape = hyper.get("model")
    hf_model = isinstance(shape, dict) and "attn_implementation" in shape
    recorded = recorded_adapter(path, hyper)
    config = None
    if adapter is not None:
        alpha, dropout, rslora = _lora_settings(recorded, lora_alpha)
        config = _lora_config(pairs, alpha, dropout, rslora, "CAUSAL_LM" if hf_model else None)
        pretrained = shape.get("pretrained") if isinstance(shape, dict) else None
        if hf_model and pretrained:
            # Where PeftModel.from_pretrained's users find the base (AutoPeftModelForCausalLM reads it).
            config.base_model_name_or_path = pretrained
    quantized = sum(1 for k in state if _QUANT_STATE.match(k))
    if dtype != "auto":
        target = DTYPES[dtype]
    elif format == "peft":
        target = next(iter(pairs.values()))[0].dtype
    elif quantized:
        target = torch.bfloat16
    else:
        target = next(
            (t.dtype for k, t in state.items() if t.is_floating_point() and not _LORA.match(k)), torch.float32
        )
    dequantized: list[str] = []
    if format != "peft":
        state, dequantized = dequantize_4bit_state(state)
    if recorded.get("kind") == "qlora" and format != "peft" and not dequantized:
        raise ConfigError(
            "checkpoint",
            os.fspath(path),
            "is of an adapter=qlora run but holds no bitsandbytes quantization state (weight.absmax, "
            "weight.quant_state.*) to dequantize its 4-bit base with; export the adapter alone with --format peft, "
            "or a checkpoint that Lightning saved with the model's full state_dict.",
        )
    if dequantized:
        warnings.warn(
            f"{len(dequantized)} base weights were 4-bit (QLoRA): the merged weights are the dequantized base plus the "
            "adapter's delta, not the weights before quantization.",
            stacklevel=2,
        )
    if format == "peft":
        if config is not None and _adapts_conv1d(shape, pairs):
            # peft's own save writes it for GPT-2: its Conv1D weights are (in, out). Without it PeftModel warned and
            # other readers of adapter_config.json took the layers for nn.Linear.
            config.fan_in_fan_out = True
        written = len(pairs) * 2
        _write_atomic(out, lambda staging: _write_peft(staging, pairs, config, target))
    else:
        model = _reference_model(shape)
        if model is not None:
            state = _to_model_layout(state, model, dequantized)
        if adapter is not None:
            merged = merge_lora(state, pairs, config, adapter, model)
        else:
            merged = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
            if model is not None:
                _restore_tied(model, merged)
        merged = {k: v.to(target) if v.is_floating_point() else v for k, v in merged.items()}
        written = len(merged)
        if format == "state_dict":
            _write_atomic(out, lambda staging: torch.save(merged, staging / "state_dict.pt"))
        else:
            _write_atomic(out, lambda staging: _write_hf(staging, model, shape, merged, target))
    return ExportReport(path, format, out, len(pairs), len(dequantized), target, written)


def _write_atomic(out: Path, write: Callable[[Path], Any]) -> None:
    """``write`` the export into a hidden folder beside ``out``, renamed to ``out`` only once complete.

    A full disk half-way through a Hugging Face directory would otherwise leave a config.json beside a short
    safetensors file, which ``from_pretrained`` would take for a model until it reads the weights.

    Raises:
        ExportWriteError: the write failed (ENOSPC, EDQUOT, EIO, ...); nothing is left at ``out``.
    """
    try:
        write_directory_atomic(out, write)
    except CheckpointWriteError as err:
        raise ExportWriteError(os.fspath(out), err.reason) from err


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``trainopt-export``; a bad input ends with its reason and exit code 2."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a .ckpt file, a ZeRO or DCP checkpoint directory, or a run folder")
    parser.add_argument("--out", required=True, help="the directory to write (new or empty)")
    parser.add_argument("--format", default="hf", choices=FORMATS, help="what to write (default: hf)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="dtype of the weights written (default auto: bfloat16 for QLoRA, else as the base was saved)",
    )
    parser.add_argument(
        "--lora-alpha", type=float, default=None, help="the adapter's alpha, when the run recorded none"
    )
    args = parser.parse_args(argv)
    try:
        report = export_checkpoint(args.checkpoint, args.out, args.format, args.dtype, args.lora_alpha)
    except TrainOptError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    merged = "merged " if report.format != "peft" and report.adapted_modules else ""
    print(
        f"wrote {report.out} ({report.format}, {str(report.dtype).removeprefix('torch.')}): {report.tensors} tensors, "
        f"{merged}{report.adapted_modules} adapted modules, {report.dequantized} 4-bit weights dequantized; "
        f"from {report.checkpoint}"
    )


if __name__ == "__main__":
    main()
