"""Convert a (sharded) ZeRO checkpoint into one consolidated fp32 state dict that loads into the plain ``GPT``.

Console script: ``trainopt-convert-zero CHECKPOINT_DIR OUTPUT.pt [--lightning-file FULL.ckpt]``.
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
    checkpoint_dir: str | os.PathLike[str], output_file: str | os.PathLike[str], lightning_file: str | None = None
) -> dict[str, torch.Tensor]:
    """Consolidate every rank's ZeRO shards into fp32 tensors keyed like ``GPT.state_dict()`` and save them.

    Wraps ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` (which keeps the
    LightningModule's keys and Lightning's client state), then strips the ``LitGPT`` / ``torch.compile`` prefixes,
    restores tied weights DeepSpeed stores once, and, when the checkpoint records the model shape, checks that the
    result loads strictly into ``GPT``.

    Args:
        checkpoint_dir: the DeepSpeed checkpoint directory Lightning wrote (``.../step3.ckpt/``).
        output_file: where to write the plain state dict (``torch.load`` + ``GPT.load_state_dict``).
        lightning_file: also keep Lightning's full converted checkpoint here (for ``load_from_checkpoint``).

    Raises:
        ConfigError: ``checkpoint_dir`` is not a DeepSpeed checkpoint directory.
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
    shape = (full.get("hyper_parameters") or {}).get("model")
    if isinstance(shape, dict):
        from lightning_trainopt.models import GPT, GPTConfig

        cfg = GPTConfig(**shape)
        if cfg.tie_embeddings and "lm_head.weight" not in state and "embed.weight" in state:
            state["lm_head.weight"] = state["embed.weight"]
        with torch.device("meta"):
            model = GPT(cfg)
        model.load_state_dict(state, strict=True, assign=True)
    torch.save(state, output_file)
    return state


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``trainopt-convert-zero``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_file")
    parser.add_argument("--lightning-file", default=None, help="also write Lightning's full fp32 checkpoint here")
    args = parser.parse_args(argv)
    state = convert_zero_to_fp32(args.checkpoint_dir, args.output_file, args.lightning_file)
    n = sum(t.numel() for k, t in state.items() if k != "lm_head.weight" or "embed.weight" not in state)
    print(f"wrote {args.output_file}: {len(state)} tensors, {n:,} parameters (fp32)")


if __name__ == "__main__":
    main()
