"""Predicted vs measured per-rank model-state bytes on 2 CPU processes (gloo), one fit per strategy x precision.

    python bench/planner_accuracy.py states            # the table (drives this file)
    python bench/planner_accuracy.py states --models   # the same for a Hugging Face Llama config and a user module
    python bench/planner_states.py zero2 bf16 OUT.json [MODEL] # one measurement: rank 0 writes OUT.json

MODEL: ``gpt_tiny`` (default, our transformer: planned analytically), ``hf_llama`` (:data:`HF_LLAMA`, a
``LitCausalLM`` from a ``config.json``) or ``user`` (``tests.helpers.user_module.UserLM``:
``nn.TransformerEncoderLayer`` blocks, dict batches, no ``configure_optimizers`` so the app's AdamW over decay groups);
the last two are planned from the module built on the meta device (``config.plan_model.module_plan_profile``), as
``plan.py model=hf|module`` plans them.

Measured: ``metrics.memory_accounting.memory_breakdown`` (the strategies' per-rank accounting) on rank 0 in
``on_before_optimizer_step`` of step 1 (gradients present, optimizer states created by step 0).
Predicted: ``planner.estimate_model_states`` for the same preset YAML, resident terms (the fp32 gradient
partition DeepSpeed builds inside ``step()`` and frees at its end is in the planner's peak, not in this snapshot).
"""

from __future__ import annotations

import contextlib
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
#: A small Llama (GQA, untied head) as a Hugging Face config.json: 4 layers of 128, 4 heads over 2 KV heads.
HF_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
USER_MODULE = "tests.helpers.user_module.UserLM"
USER_ARGS = {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4}
#: (model, strategy, precision) measured for the models planned from their module.
MODEL_COMBOS = [("hf_llama", "zero2", "bf16"), ("hf_llama", "zero3", "fp32"), ("user", "zero3", "bf16")]


def hf_config_dir() -> Path:
    """A directory holding :data:`HF_LLAMA`'s config.json (no download), named by its fields and written whole
    once: the 2 ranks of a measurement read it while neither writes."""
    import hashlib

    import transformers

    digest = hashlib.sha1(json.dumps(HF_LLAMA, sort_keys=True).encode()).hexdigest()[:12]
    directory = Path(tempfile.gettempdir()) / f"trainopt_bench_hf_llama_{digest}"
    if not (directory / "config.json").is_file():
        staging = Path(tempfile.mkdtemp(prefix="trainopt_bench_hf_"))
        transformers.LlamaConfig(**HF_LLAMA).save_pretrained(staging)
        with contextlib.suppress(OSError):  # another process wrote it first
            staging.rename(directory)
    return directory


def build_module(model: str) -> Any:
    """The LightningModule of ``model`` (its inner model built by ``configure_model``, as training builds it)."""
    import types
    from functools import partial

    import torch

    if model == "hf_llama":
        from lightning_trainopt.models import HFModelConfig, LitCausalLM

        return LitCausalLM(HFModelConfig(config=str(hf_config_dir())))
    from lightning_trainopt.models.optimization import configure_optimizers
    from tests.helpers.user_module import UserLM

    module = UserLM(**USER_ARGS)
    # What train.py gives a module without configure_optimizers (config.model_factory): AdamW over the decay groups.
    adamw = partial(torch.optim.AdamW, lr=3e-4)
    module.configure_optimizers = types.MethodType(lambda self: configure_optimizers(self, adamw, None), module)
    return module


def _datamodule(model: str, vocab_size: int) -> Any:
    if model == "user":
        from tests.helpers.user_module import PaddedTokens

        return PaddedTokens(batch_size=BATCH, seq_len=SEQ, vocab_size=vocab_size)
    from lightning_trainopt.data import TextDataModule

    return TextDataModule(
        corpus="synthetic", seq_len=SEQ, batch_size=BATCH, vocab_size=vocab_size, synthetic_tokens=200_000
    )


def measure(strategy: str, precision: str, out: str, model_name: str = MODEL) -> None:
    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.metrics.memory_accounting import memory_breakdown
    from lightning_trainopt.models import GPTConfig, LitGPT
    from lightning_trainopt.precision import PrecisionSpec
    from lightning_trainopt.precision.plugins import trainer_precision_kwargs

    conf = ROOT / "lightning_trainopt" / "conf"
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

    module = LitGPT(GPTConfig(**model)) if model_name == MODEL else build_module(model_name)
    dm = _datamodule(model_name, model["vocab_size"])
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


def profile(model_name: str = MODEL) -> Any:
    """The planner's profile: our transformer's analytic one, or one read from the module built on ``meta``."""
    import torch
    from omegaconf import OmegaConf

    from lightning_trainopt.models import GPTConfig
    from lightning_trainopt.planner import gpt_profile

    if model_name == MODEL:
        node = OmegaConf.to_container(OmegaConf.load(ROOT / "lightning_trainopt" / "conf" / "model" / f"{MODEL}.yaml"))
        return gpt_profile(GPTConfig(**{k: v for k, v in node.items() if k != "_target_"}))
    from lightning_trainopt.config.plan_model import module_plan_profile

    with torch.device("meta"):
        module = build_module(model_name)
        module.configure_model()
    return module_plan_profile(module, model_name)


def predict(strategy: str, precision: str, model_name: str = MODEL) -> dict[str, int]:
    from omegaconf import OmegaConf

    from lightning_trainopt.config.plan_inputs import strategy_layout
    from lightning_trainopt.planner import OPTIMIZER_STATES, estimate_model_states

    conf = ROOT / "lightning_trainopt" / "conf"
    p = profile(model_name)
    tp = str(OmegaConf.load(conf / "precision" / f"{precision}.yaml").trainer_precision)
    layout = strategy_layout(OmegaConf.load(conf / "strategy" / f"{strategy}.yaml"), 2)
    # Rank 0, like the measurement (ranks differ only in ZeRO-2's straddling gradient partition).
    est = estimate_model_states(
        p.param_groups,
        tp,
        layout,
        OPTIMIZER_STATES["adamw"],
        2,
        rank=0,
        module_trace=p.module_trace,
        fsdp_units=p.fsdp_units,
    )
    return {
        c: sum(est.bytes(c, loc, resident_only=True) for loc in ("device", "cpu", "nvme"))
        for c in ("params", "grads", "optimizer_states")
    }


def states_rows(combos: list[tuple[str, str]] | None = None, model_name: str = MODEL) -> list[dict[str, Any]]:
    rows = []
    if model_name == "hf_llama":
        hf_config_dir()  # before the ranks start
    for strategy, precision in combos or COMBOS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "states.json"
            env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
            proc = subprocess.run(
                [sys.executable, __file__, strategy, precision, str(out), model_name],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if not out.is_file():
                raise RuntimeError(f"{strategy}/{precision} produced no measurement:\n{proc.stderr[-3000:]}")
            measured = json.loads(out.read_text())
        predicted = predict(strategy, precision, model_name)
        for cat in ("params", "grads", "optimizer_states", "total"):
            m = (
                sum(measured[c][loc] for c in measured for loc in measured[c])
                if cat == "total"
                else sum(measured[cat].values())
            )
            p = sum(predicted.values()) if cat == "total" else predicted[cat]
            rows.append(
                {
                    "model": model_name,
                    "strategy": strategy,
                    "precision": precision,
                    "category": cat,
                    "predicted": p,
                    "measured": m,
                    "error": (p / m - 1) if m else (0.0 if p == 0 else float("inf")),
                }
            )
    return rows


def model_states_rows() -> list[dict[str, Any]]:
    """:func:`states_rows` for each of :data:`MODEL_COMBOS`."""
    return [r for model, strategy, precision in MODEL_COMBOS for r in states_rows([(strategy, precision)], model)]


if __name__ == "__main__":
    measure(*sys.argv[1:5])
