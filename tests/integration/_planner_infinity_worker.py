"""Worker for tests/integration/test_planner_infinity.py (run as a script; Lightning re-runs it for rank 1).

Usage: python tests/integration/_planner_infinity_worker.py OUT_JSON PRECISION KEY=VALUE...
  PRECISION: a conf/precision preset (bf16, fp32); KEY=VALUE: overrides of conf/strategy/zero_infinity.yaml.
Fits gpt_tiny for 2 steps on 2 CPU processes (gloo) and writes, from rank 0, the bytes of the host buffers DeepSpeed
really allocated, read from the engine's own objects (numel x element_size), keyed by the planner's term labels.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from lightning_trainopt.config.strategy import build_strategy  # noqa: E402
from lightning_trainopt.data import TextDataModule  # noqa: E402
from lightning_trainopt.models import GPTConfig, LitGPT  # noqa: E402
from lightning_trainopt.parallel.spec import precision_needs  # noqa: E402
from lightning_trainopt.precision import PrecisionSpec  # noqa: E402
from lightning_trainopt.precision.plugins import trainer_precision_kwargs  # noqa: E402


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a narrow view keeps its whole base alive)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class Probe(pl.Callback):
    """Reads DeepSpeed's buffers on rank 0: Adam's first-step moments, then everything before the second step."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.first_step_moments = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = trainer.strategy.model.optimizer
        cpu_adam = opt.optimizer
        step = cpu_adam.step
        probe = self

        def recording_step(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            if trainer.global_step == 0:
                for group in cpu_adam.param_groups:
                    for p in group["params"]:
                        state = cpu_adam.state.get(p, {})
                        moments = sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
                        probe.first_step_moments = max(probe.first_step_moments, moments)
            return result

        cpu_adam.step = recording_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != 1 or not trainer.is_global_zero:
            return
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

        opt = trainer.strategy.model.optimizer
        kept = [i for i in range(len(opt.fp16_groups)) if not opt._swappable_optimizer_subgroup(i)]
        swappers = [o for o in gc.get_objects() if isinstance(o, AsyncPartitionedParameterSwapper)]
        unswapped = [
            t for info in opt.optimizer_swapper.swap_params_info.values() for t in info.unswapped_gradients.values()
        ]
        h = opt.fp16_groups[0][0].ds_tensor.element_size()
        measured = {
            "optimizer swap buffers (pinned)": sum(
                _nbytes(b) for b in opt.optimizer_swapper.swap_buffer_manager.all_buffers
            ),
            "parameter swap buffers (pinned)": sum(_nbytes(s.buffers) for s in swappers),
            "parameter swap-out reuse buffer (pinned)": sum(_nbytes(s.partitioned_swap_buffer) for s in swappers),
            "weight partitions, CPU flat buffers (max_in_cpu)": sum(
                _nbytes(t) for t in opt.param_groups_fp16_flat_cpu_memory
            ),
            "weight partitions beyond max_in_cpu": h
            * sum(
                n
                for n, flat in zip(opt.fp16_partitioned_groups_flat_numel, opt.fp16_partitioned_groups_flat)
                if flat is None
            ),
            "gradient partitions": _nbytes(opt.grad_partitions_flat_buffer),
            "fp32 gradient buffer (sub-groups < 1 MiB)": sum(
                _nbytes(opt.fp32_partitioned_groups_flat[i].grad) for i in kept
            ),
            "fp32 master partition (sub-groups < 1 MiB)": sum(
                _nbytes(opt.fp32_partitioned_groups_flat[i]) for i in kept
            ),
            "DeepSpeedCPUAdam (sub-groups < 1 MiB)": sum(
                _nbytes(v)
                for i in kept
                for v in opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[i], {}).values()
                if isinstance(v, torch.Tensor)
            ),
            "DeepSpeedCPUAdam before its first swap-out (first step)": self.first_step_moments,
            "fp32 gradients too small or unaligned to swap": _storage_bytes(unswapped),
            "swapper count": len(swappers),
            "device": str(opt.grad_partitions_flat_buffer.device),
        }
        self.out.write_text(json.dumps(measured))


def main(out: str, precision: str, *overrides: str) -> None:
    conf = ROOT / "lightning_trainopt" / "conf"
    node = OmegaConf.merge(OmegaConf.load(conf / "strategy" / "zero_infinity.yaml"), OmegaConf.from_dotlist(overrides))
    model = dict(OmegaConf.to_container(OmegaConf.load(conf / "model" / "gpt_tiny.yaml")))
    model.pop("_target_")
    spec_node = OmegaConf.to_container(OmegaConf.load(conf / "precision" / f"{precision}.yaml"))
    spec = PrecisionSpec(**{k: v for k, v in spec_node.items() if k != "_target_"})
    trainer_cfg = OmegaConf.create({"accelerator": "cpu", "devices": 2, "num_nodes": 1, "accumulate_grad_batches": 1})
    strategy = build_strategy(node, spec, trainer_cfg, micro_batch_size=2)
    dm = TextDataModule(
        corpus="synthetic", seq_len=32, batch_size=2, vocab_size=model["vocab_size"], synthetic_tokens=20_000
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
        callbacks=[Probe(Path(out))],
        **trainer_precision_kwargs(spec, precision_needs(strategy)),
    )
    trainer.fit(LitGPT(GPTConfig(**model)), datamodule=dm)
    from lightning_trainopt.launch.multirun import teardown_distributed

    teardown_distributed()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main(*sys.argv[1:])
    # The measurement is written. Leave without the interpreter's teardown: DeepSpeed's NVMe (async I/O) threads
    # aborted it once ("terminate called without an active exception", exit -6) after a complete run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
