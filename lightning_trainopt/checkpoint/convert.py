"""Convert a (sharded) ZeRO checkpoint into one consolidated fp32 state dict that loads into the plain model.

Console script: ``trainopt-convert-zero CHECKPOINT_DIR OUTPUT.pt [--lightning-file FULL.ckpt] [--hf-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

from lightning_trainopt.exceptions import ConfigError

__all__ = ["convert_zero_to_fp32", "main"]

_PREFIXES = ("model.", "_orig_mod.")


def _strip(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state_dict.items():
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def convert_zero_to_fp32(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    lightning_file: str | None = None,
    hf_dir: str | os.PathLike[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Consolidate every rank's ZeRO shards into fp32 tensors keyed like the plain model's ``state_dict()``; save them.

    Wraps ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` (which keeps the
    LightningModule's keys and Lightning's client state), then strips the LightningModule's / ``torch.compile``
    prefixes, restores tied weights DeepSpeed stores once, and checks that the result loads strictly into the plain
    model the checkpoint's hyper-parameters describe: ``GPT`` for our presets, the Hugging Face model for
    ``model=hf`` (keys as its own ``state_dict()``, e.g. ``model.embed_tokens.weight``).

    Args:
        checkpoint_dir: the DeepSpeed checkpoint directory Lightning wrote (``.../step3.ckpt/``).
        output_file: where to write the plain state dict (``torch.load`` + ``GPT.load_state_dict``).
        lightning_file: also keep Lightning's full converted checkpoint here (for ``load_from_checkpoint``).
        hf_dir: for a ``model=hf`` run, also ``save_pretrained`` the model here (config and safetensors, loadable
            with ``model.pretrained=...`` or ``AutoModelForCausalLM.from_pretrained``).

    Raises:
        ConfigError: ``checkpoint_dir`` is not a DeepSpeed checkpoint directory; ``hf_dir`` for a run that is not
            ``model=hf``.
    """
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    if not os.path.isdir(os.path.join(checkpoint_dir, "checkpoint")):
        raise ConfigError(
            "checkpoint_dir", str(checkpoint_dir), "give a DeepSpeed checkpoint directory (it holds checkpoint/)."
        )
    with tempfile.TemporaryDirectory() as tmp:
        target = lightning_file or os.path.join(tmp, "lightning.ckpt")
        full: dict[str, Any] = convert_zero_checkpoint_to_fp32_state_dict(os.fspath(checkpoint_dir), target)
    state = _strip(full["state_dict"])
    model = _reference_model((full.get("hyper_parameters") or {}).get("model"))
    if model is not None:
        _restore_tied(model, state)
        model.load_state_dict(state, strict=True, assign=True)
    torch.save(state, output_file)
    if hf_dir is not None:
        save = getattr(model, "save_pretrained", None)
        if not callable(save):
            raise ConfigError("--hf-dir", str(hf_dir), "the checkpoint is not of a model=hf run; drop --hf-dir.")
        save(os.fspath(hf_dir))
    return state


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


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``trainopt-convert-zero``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_file")
    parser.add_argument("--lightning-file", default=None, help="also write Lightning's full fp32 checkpoint here")
    parser.add_argument("--hf-dir", default=None, help="model=hf runs: also save_pretrained the model here")
    args = parser.parse_args(argv)
    state = convert_zero_to_fp32(args.checkpoint_dir, args.output_file, args.lightning_file, args.hf_dir)
    n = sum(t.numel() for k, t in state.items() if k != "lm_head.weight" or "embed.weight" not in state)
    print(f"wrote {args.output_file}: {len(state)} tensors, {n:,} parameters (fp32)")


if __name__ == "__main__":
    main()
