"""Turn a sharded checkpoint (DeepSpeed ZeRO, or a DCP directory of FSDP2/TP) into one plain fp32 state dict or a
Hugging Face model directory.

Console script: ``trainopt-convert CHECKPOINT OUTPUT.pt [--hf-dir DIR] [--lightning-file FULL.ckpt]``
(``trainopt-convert-zero`` is the same command under its former name).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_trainopt.checkpoint.dcp import is_dcp_checkpoint, read_dcp_tensors
from lightning_trainopt.exceptions import ConfigError

__all__ = ["convert_checkpoint", "convert_zero_to_fp32", "main", "read_checkpoint_weights"]

_PREFIXES = ("model.", "_orig_mod.")


def _strip(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state_dict.items():
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def _is_deepspeed(path: str | os.PathLike[str]) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoint"))


def convert_checkpoint(
    checkpoint: str | os.PathLike[str],
    output_file: str | os.PathLike[str] | None,
    hf_dir: str | os.PathLike[str] | None = None,
    lightning_file: str | os.PathLike[str] | None = None,
) -> dict[str, torch.Tensor]:
    """One plain fp32 state dict of a sharded checkpoint, keyed like the plain model's ``state_dict()``.

    Reads a DeepSpeed ZeRO checkpoint directory (:func:`convert_zero_to_fp32`) or a torch distributed checkpoint
    (DCP) directory that FSDP2 or tensor parallelism wrote, on one process whatever the number of ranks that wrote
    it (:func:`~lightning_trainopt.checkpoint.dcp.read_dcp_tensors`: the weights only, not the optimizer state).
    The LightningModule's / ``torch.compile`` prefixes are stripped and the result is checked to load strictly into
    the plain model the checkpoint's hyper-parameters describe: ``GPT`` for our presets, the Hugging Face model for
    ``model=hf``.

    Args:
        checkpoint: the checkpoint directory Lightning wrote (``.../last.ckpt/``).
        output_file: where to write the plain state dict (``torch.load`` + ``load_state_dict``); ``None``: not
            written (e.g. only ``hf_dir``).
        hf_dir: also write a Hugging Face model directory here (``config.json`` + safetensors, loadable with
            ``AutoModelForCausalLM.from_pretrained`` or ``model=hf model.pretrained=...``): a ``model=hf`` run's own
            architecture, our GPT presets as ``LlamaForCausalLM``.
        lightning_file: also keep a full Lightning checkpoint file here (for ``load_from_checkpoint``): loops,
            hyper-parameters and the weights.

    Raises:
        ConfigError: ``checkpoint`` is neither checkpoint directory; ``hf_dir`` for a run that is neither a
            ``model=hf`` run nor one of our GPT presets.
    """
    if is_dcp_checkpoint(checkpoint):
        state, hyper = _read_dcp(checkpoint, lightning_file)
    elif _is_deepspeed(checkpoint):
        state, hyper = _read_zero(checkpoint, lightning_file)
    else:
        raise ConfigError(
            "checkpoint",
            os.fspath(checkpoint),
            "give a DeepSpeed checkpoint directory (it holds checkpoint/) or an FSDP2/TP checkpoint directory "
            "(it holds DCP's .metadata); a single-file .ckpt already holds the whole model under state_dict.",
        )
    shape = hyper.get("model")
    model = _reference_model(shape)
    if model is not None:
        _restore_tied(model, state)
        model.load_state_dict(state, strict=True, assign=True)
    if output_file is not None:
        torch.save(state, output_file)
    if hf_dir is not None:
        _save_hf(model, shape, state, hf_dir)
    return state


def read_checkpoint_weights(checkpoint: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(plain state dict, hyper-parameters)`` of any checkpoint this app writes, on one process.

    A Lightning ``.ckpt`` file, a DeepSpeed ZeRO directory or a DCP directory (FSDP2/TP), read as
    :func:`convert_checkpoint` reads them; keys are the plain model's (the LightningModule's ``model.`` stripped),
    tied weights as the checkpoint saved them.

    Raises:
        ConfigError: ``checkpoint`` is none of them.
    """
    if os.path.isfile(checkpoint):
        full = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)
        if not isinstance(full, Mapping) or not isinstance(full.get("state_dict"), Mapping):
            raise ConfigError("checkpoint", os.fspath(checkpoint), "not a Lightning checkpoint (it has no state_dict).")
        return _strip(full["state_dict"]), dict(full.get("hyper_parameters") or {})
    if is_dcp_checkpoint(checkpoint):
        return _read_dcp(checkpoint, None)
    if _is_deepspeed(checkpoint):
        return _read_zero(checkpoint, None)
    raise ConfigError(
        "checkpoint",
        os.fspath(checkpoint),
        "give a Lightning .ckpt file, a DeepSpeed checkpoint directory (it holds checkpoint/) or an FSDP2/TP "
        "checkpoint directory (it holds DCP's .metadata).",
    )


def convert_zero_to_fp32(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    lightning_file: str | None = None,
    hf_dir: str | os.PathLike[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Consolidate every rank's ZeRO shards into fp32 tensors keyed like the plain model's ``state_dict()``; save them.

    Wraps ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` (which keeps the
    LightningModule's keys and Lightning's client state), restores tied weights DeepSpeed stores once; the rest is
    :func:`convert_checkpoint`'s.

    Args:
        checkpoint_dir: the DeepSpeed checkpoint directory Lightning wrote (``.../step3.ckpt/``).
        output_file: where to write the plain state dict (``torch.load`` + ``GPT.load_state_dict``).
        lightning_file: also keep Lightning's full converted checkpoint here (for ``load_from_checkpoint``).
        hf_dir: also write a Hugging Face model directory here (see :func:`convert_checkpoint`).

    Raises:
        ConfigError: ``checkpoint_dir`` is not a DeepSpeed checkpoint directory; ``hf_dir`` for a run whose model
            has no Hugging Face form.
    """
    if not _is_deepspeed(checkpoint_dir):
        raise ConfigError(
            "checkpoint_dir", str(checkpoint_dir), "give a DeepSpeed checkpoint directory (it holds checkpoint/)."
        )
    return convert_checkpoint(checkpoint_dir, output_file, hf_dir, lightning_file)


def _read_zero(path: str | os.PathLike[str], lightning_file: str | os.PathLike[str] | None) -> tuple[dict, dict]:
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    with tempfile.TemporaryDirectory() as tmp:
        target = os.fspath(lightning_file or os.path.join(tmp, "lightning.ckpt"))
        full: dict[str, Any] = convert_zero_checkpoint_to_fp32_state_dict(os.fspath(path), target)
    return _strip(full["state_dict"]), full.get("hyper_parameters") or {}


def _read_dcp(path: str | os.PathLike[str], lightning_file: str | os.PathLike[str] | None) -> tuple[dict, dict]:
    from lightning_trainopt.checkpoint.state import lightning_state

    weights = read_dcp_tensors(path, "state_dict.")
    meta = dict(lightning_state(Path(path)))
    if lightning_file is not None:
        torch.save({**meta, "state_dict": weights}, lightning_file)
    return _strip(weights), meta.get("hyper_parameters") or {}


def _save_hf(model: torch.nn.Module | None, shape: Any, state: dict[str, torch.Tensor], hf_dir: Any) -> None:
    save = getattr(model, "save_pretrained", None)
    if callable(save):
        save(os.fspath(hf_dir))
        return
    if isinstance(shape, dict) and "d_model" in shape:
        from lightning_trainopt.checkpoint.hf_export import gpt_to_llama
        from lightning_trainopt.models import GPTConfig

        gpt_to_llama(state, GPTConfig(**shape), hf_dir)
        return
    raise ConfigError(
        "--hf-dir", str(hf_dir), "the checkpoint is neither of a model=hf run nor of a GPT preset; drop --hf-dir."
    )


def _reference_model(shape: Any) -> torch.nn.Module | None:
    """The plain model the checkpoint's hyper-parameters describe, on the meta device: our ``GPT`` or the Hugging Face
    model of a ``model=hf`` run (``None`` for another LightningModule: its state dict is written unchecked)."""
    if not isinstance(shape, dict):
        return None
    if "attn_implementation" in shape:
        from lightning_trainopt.models import HFModelConfig, LitCausalLM

        with torch.device("meta"):
            module = LitCausalLM(HFModelConfig(**shape))
            module.configure_model()
        return module.model
    if "d_model" in shape:
        from lightning_trainopt.models import GPT, GPTConfig

        with torch.device("meta"):
            return GPT(GPTConfig(**shape))
    return None


def _restore_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give every name of a shared parameter (a tied ``lm_head``) the tensor DeepSpeed stored once."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        present = [n for n in group if n in state]
        for name in group:
            if present and name not in state:
                state[name] = state[present[0]]


def _tied_head(key: str, tensor: torch.Tensor, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``key`` is an output head equal to another tensor of ``state`` (the embedding it is tied to)."""
    if not key.endswith("lm_head.weight"):
        return False
    return any(k != key and t.shape == tensor.shape and torch.equal(t, tensor) for k, t in state.items())


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``trainopt-convert`` (and its former name ``trainopt-convert-zero``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", help="a DeepSpeed or DCP (FSDP2/TP) checkpoint directory")
    parser.add_argument("output_file", nargs="?", default=None, help="the plain state dict to write (.pt)")
    parser.add_argument("--lightning-file", default=None, help="also write a full Lightning checkpoint file here")
    parser.add_argument(
        "--hf-dir", default=None, help="also write a Hugging Face model directory here (model=hf runs, GPT presets)"
    )
    args = parser.parse_args(argv)
    if args.output_file is None and args.hf_dir is None:
        parser.error("give OUTPUT_FILE, --hf-dir DIR or both")
    state = convert_checkpoint(args.checkpoint, args.output_file, args.hf_dir, args.lightning_file)
    n = sum(t.numel() for k, t in state.items() if not _tied_head(k, t, state))
    written = [p for p in (args.output_file, args.hf_dir) if p is not None]
    print(f"wrote {' and '.join(written)}: {len(state)} tensors, {n:,} parameters (fp32)")


if __name__ == "__main__":
    main()
