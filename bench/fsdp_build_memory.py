"""Peak host memory per rank while FSDP2 (or TP x FSDP2) builds a model: the whole-model build versus the meta-device
build.

Each mode runs as its own N-process fit of ``TrainOptFSDPStrategy`` (``--strategy fsdp_tp``: ``TrainOptTPStrategy``
with tensor_parallel_size=2, FSDP2 over the ranks left) (gloo on CPU) that stops at ``on_fit_start``, i.e. right
after ``configure_model``, the split (TP, ``fully_shard``) and (meta mode) the shard-by-shard initialisation or read of
the pretrained weights. Each rank resets its peak RSS (``/proc/self/clear_refs``, Linux) in the callback's ``setup``
(before ``configure_model``) and reads ``VmHWM`` at ``on_fit_start``: the peak RSS growth during the build, next to
the model's fp32 bytes::

    python bench/fsdp_build_memory.py                    # gpt_350m, both modes, 2 ranks
    python bench/fsdp_build_memory.py --model gpt_125m --modes meta
    python bench/fsdp_build_memory.py --model hf_pretrained --ranks 4   # model=hf model.pretrained=DIR
    python bench/fsdp_build_memory.py --model hf_pretrained --ranks 4 --strategy fsdp_tp --modes meta  # TP 2 x FSDP2 2

``hf_pretrained``: a Hugging Face ``LlamaForCausalLM`` of gpt_350m's shape (359.8M parameters, tied embeddings) with
random weights, saved once by ``save_pretrained`` into a temporary directory (fp32 safetensors in 200 MB files with
an index), then loaded as ``model=hf model.pretrained=DIR`` is: ``from_pretrained`` on every rank (``whole``) or
built on meta and read slice by slice (``meta``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MODES = {"whole": False, "meta": True}
STRATEGIES = ("fsdp", "fsdp_tp")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status (Linux only)")


#: gpt_350m's shape as a Hugging Face Llama config.
HF_350M = {
    "vocab_size": 50304,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def _save_hf(directory: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_350M))
    model.save_pretrained(directory, max_shard_size="200MB")


def _worker(model: str, meta: bool, out: Path, ranks: int, weights: Path | None, strategy: str) -> None:
    import lightning.pytorch as pl
    import torch
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_trainopt.models import HFModelConfig, LitCausalLM, LitGPT
    from lightning_trainopt.models.config import GPTConfig
    from lightning_trainopt.parallel import TrainOptFSDPStrategy, TrainOptTPStrategy

    module: pl.LightningModule
    if weights is not None:
        module = LitCausalLM(HFModelConfig(pretrained=str(weights)))
    else:
        conf = Path(__file__).resolve().parents[1] / "lightning_trainopt" / "conf" / "model" / f"{model}.yaml"
        shape = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(conf)).items() if k != "_target_"}  # type: ignore[union-attr]
        module = LitGPT(GPTConfig(**shape))

    class BuildPeak(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.before = _status_kib("VmRSS")

        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            peak = _status_kib("VmHWM")
            n = sum(p.numel() for p in pl_module.parameters())
            row = {"rank": trainer.global_rank, "rss_before_kib": self.before, "peak_kib": peak, "n_params": n}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))
            trainer.should_stop = True  # nothing more to measure: no step runs

    pl.seed_everything(1234, verbose=False)
    data = DataLoader(TensorDataset(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy=(
            TrainOptTPStrategy(tensor_parallel_size=2, meta_init=meta, preset="fsdp_tp")
            if strategy == "fsdp_tp"
            else TrainOptFSDPStrategy(meta_init=meta)
        ),
        max_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[BuildPeak()],
    )
    trainer.fit(module, data)


def _run(model: str, mode: str, ranks: int, weights: Path | None, strategy: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--worker", mode, "--model", model, "--out", tmp, "--ranks", str(ranks)]
        cmd += ["--strategy", strategy]
        if weights is not None:
            cmd += ["--weights", str(weights)]
        # This checkout's package, also in the rank Lightning starts by re-running this script.
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"})
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_350m", help="a conf/model/gpt_*.yaml preset, or hf_pretrained")
    parser.add_argument("--ranks", type=int, default=2, help="processes (gloo on CPU)")
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="fsdp", choices=STRATEGIES, help="fsdp_tp: TP 2 x FSDP2 over the rest")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.model, MODES[args.worker], args.out, args.ranks, args.weights, args.strategy)
        return
    with tempfile.TemporaryDirectory() as tmp:
        weights = None
        if args.model == "hf_pretrained":
            weights = Path(tmp) / "weights"
            _save_hf(weights)
        print(
            "| model | strategy | ranks | build | rank | RSS before (MiB) | peak RSS growth (MiB) | model fp32 (MiB) "
            "| ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for mode in args.modes:
            for row in _run(args.model, mode, args.ranks, weights, args.strategy):
                grown = (row["peak_kib"] - row["rss_before_kib"]) / 1024
                fp32 = row["n_params"] * 4 / 2**20
                print(
                    f"| {args.model} | {args.strategy} | {args.ranks} | {mode} | {row['rank']} | "
                    f"{row['rss_before_kib'] / 1024:.0f} | {grown:.0f} | {fp32:.0f} | {grown / fp32:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
