"""Predicted vs measured per-rank model-state bytes on 2 CPU processes (gloo), one fit per strategy x precision.

    python bench/planner_accuracy.py states            # the table (drives this file)
    python bench/planner_states.py zero2 bf16 OUT.json # one measurement: rank 0 writes OUT.json

Measured: ``core.memory_accounting.memory_breakdown`` (the strategies' per-rank accounting) on rank 0 in
``on_before_optimizer_step`` of step 1 (gradients present, optimizer states created by step 0).
Predicted: ``core.estimate.estimate_model_states`` for the same preset YAML, resident terms (the fp32 gradient
partition DeepSpeed builds inside ``step()`` and frees at its end is in the planner's peak, not in this snapshot).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMBOS = [
    ("ddp", "fp32"),
    ("ddp", "bf16"),
    ("zero1", "bf16"),
    ("zero2", "bf16"),
    ("zero3", "bf16"),
    ("zero2", "fp32"),
    ("zero3", "fp32"),
    ("zero2_offload", "bf16"),
    ("zero3_offload", "bf16"),
]
MODEL = "gpt_tiny"
SEQ, BATCH = 64, 4


def measure(strategy: str, precision: str, out: str) -> None:
    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    from lightning_trainopt.core.memory_accounting import memory_breakdown
    from lightning_trainopt.data import TextDataModule
    from lightning_trainopt.models import GPTConfig, LitGPT
    from lightning_trainopt.precision import PrecisionSpec
    from lightning_trainopt.precision.plugins import trainer_precision_kwargs
    from lightning_trainopt.strategies import build_strategy

    conf = ROOT / "conf"
    model = {
        k: v
        for k, v in OmegaConf.to_container(OmegaConf.load(conf / "model" / f"{MODEL}.yaml")).items()
        if k != "_target_"
    }
    spec_node = OmegaConf.to_container(OmegaConf.load(conf / "precision" / f"{precision}.yaml"))
    spec = PrecisionSpec(**{k: v for k, v in spec_node.items() if k != "_target_"})
    trainer_cfg = OmegaConf.create(
        {"accelerator": "cpu", "devices": 2, "num_nodes": 1, "accumulate_grad_batches": 1, "gradient_clip_val": 1.0}
    )
    strategy = build_strategy(
        OmegaConf.load(conf / "strategy" / f"{strategy}.yaml"), spec, trainer_cfg, micro_batch_size=BATCH
    )

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
            if trainer.global_step == 1 and trainer.is_global_zero:
                mb = memory_breakdown(pl_module, trainer.optimizers, compute_device="cpu")
                Path(out).write_text(json.dumps(mb.to_dict()))

    module = LitGPT(GPTConfig(**model))
    dm = TextDataModule(
        corpus="synthetic", seq_len=SEQ, batch_size=BATCH, vocab_size=model["vocab_size"], synthetic_tokens=200_000
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Probe()],
        **trainer_precision_kwargs(spec, strategy),
    )
    trainer.fit(module, datamodule=dm)


def predict(strategy: str, precision: str) -> dict[str, int]:
    from omegaconf import OmegaConf

    from lightning_trainopt.app.plan_inputs import strategy_layout
    from lightning_trainopt.core.estimate import OPTIMIZER_STATES, estimate_model_states, gpt_param_groups
    from lightning_trainopt.models import GPTConfig

    conf = ROOT / "conf"
    model = GPTConfig(
        **{
            k: v
            for k, v in OmegaConf.to_container(OmegaConf.load(conf / "model" / f"{MODEL}.yaml")).items()
            if k != "_target_"
        }
    )
    tp = str(OmegaConf.load(conf / "precision" / f"{precision}.yaml").trainer_precision)
    layout = strategy_layout(OmegaConf.load(conf / "strategy" / f"{strategy}.yaml"), 2)
    # Rank 0, like the measurement (ranks differ only in ZeRO-2's straddling gradient partition).
    est = estimate_model_states(gpt_param_groups(model), tp, layout, OPTIMIZER_STATES["adamw"], 2, rank=0)
    return {
        c: sum(est.bytes(c, loc, resident_only=True) for loc in ("device", "cpu", "nvme"))
        for c in ("params", "grads", "optimizer_states")
    }


def states_rows(combos: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    rows = []
    for strategy, precision in combos or COMBOS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "states.json"
            env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
            proc = subprocess.run(
                [sys.executable, __file__, strategy, precision, str(out)],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if not out.is_file():
                raise RuntimeError(f"{strategy}/{precision} produced no measurement:\n{proc.stderr[-3000:]}")
            measured = json.loads(out.read_text())
        predicted = predict(strategy, precision)
        for cat in ("params", "grads", "optimizer_states", "total"):
            m = (
                sum(measured[c][loc] for c in measured for loc in measured[c])
                if cat == "total"
                else sum(measured[cat].values())
            )
            p = sum(predicted.values()) if cat == "total" else predicted[cat]
            rows.append(
                {
                    "strategy": strategy,
                    "precision": precision,
                    "category": cat,
                    "predicted": p,
                    "measured": m,
                    "error": (p / m - 1) if m else (0.0 if p == 0 else float("inf")),
                }
            )
    return rows


if __name__ == "__main__":
    measure(*sys.argv[1:4])
