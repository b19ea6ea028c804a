"""Peak host memory per rank while FSDP2 builds a model: the whole-model build versus the meta-device build.

Each mode runs as its own 2-process fit of ``TrainOptFSDPStrategy`` (gloo on CPU) that stops at ``on_fit_start``,
i.e. right after ``configure_model``, ``fully_shard`` and (meta mode) the shard-by-shard initialisation. Each rank
resets its peak RSS (``/proc/self/clear_refs``, Linux) in the callback's ``setup`` (before ``configure_model``) and
reads ``VmHWM`` at ``on_fit_start``: the peak RSS growth during the build, next to the model's fp32 bytes::

    python bench/fsdp_build_memory.py                    # gpt_350m, both modes, 2 ranks
    python bench/fsdp_build_memory.py --model gpt_125m --modes meta
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


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status (Linux only)")


def _worker(model: str, meta: bool, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_trainopt.models import LitGPT
    from lightning_trainopt.models.config import GPTConfig
    from lightning_trainopt.parallel import TrainOptFSDPStrategy

    conf = Path(__file__).resolve().parents[1] / "lightning_trainopt" / "conf" / "model" / f"{model}.yaml"
    shape = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(conf)).items() if k != "_target_"}  # type: ignore[union-attr]
    config = GPTConfig(**shape)

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
        devices=2,
        strategy=TrainOptFSDPStrategy(meta_init=meta),
        max_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[BuildPeak()],
    )
    trainer.fit(LitGPT(config), data)


def _run(model: str, mode: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--worker", mode, "--model", model, "--out", tmp]
        # This checkout's package, also in the rank Lightning starts by re-running this script.
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"})
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_350m", help="a conf/model/gpt_*.yaml preset")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.model, MODES[args.worker], args.out)
        return
    print("| model | build | rank | RSS before (MiB) | peak RSS growth (MiB) | model fp32 (MiB) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for row in _run(args.model, mode):
            grown = (row["peak_kib"] - row["rss_before_kib"]) / 1024
            fp32 = row["n_params"] * 4 / 2**20
            print(
                f"| {args.model} | {mode} | {row['rank']} | {row['rss_before_kib'] / 1024:.0f} | {grown:.0f} | "
                f"{fp32:.0f} | {grown / fp32:.2f} |"
            )


if __name__ == "__main__":
    main()
