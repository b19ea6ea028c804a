"""GPU check: the planner's predicted peak against ``torch.cuda.max_memory_allocated`` for gpt_1b under bf16-mixed.

    python bench/planner_accuracy.py gpu     # rows with and without activation checkpointing (needs CUDA)

One device, Lightning AMP's layout (fp32 weights, grads and AdamW states; bf16 autocast with the weight cast cache
off, as Lightning's MixedPrecision sets it), torch AdamW with the fused kernel that ``train.py`` gives the ``adamw``
preset on CUDA, ``zero_grad(set_to_none=True)``: the ops ``LitGPT.training_step`` runs.
Step 1 creates the optimizer states; the peak is read over step 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_trainopt.models import GPT, GPTConfig  # noqa: E402
from lightning_trainopt.planner import (  # noqa: E402
    OPTIMIZER_STATES,
    ActivationPolicy,
    PlanInputs,
    StrategyLayout,
    estimate_plan,
)

ROOT = Path(__file__).resolve().parents[1]


def _gpt_1b() -> GPTConfig:
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(ROOT / "lightning_trainopt" / "conf" / "model" / "gpt_1b.yaml"))
    return GPTConfig(**{k: v for k, v in node.items() if k != "_target_"})


def gpu_row(checkpoint: bool, micro_batch: int = 2, seq_len: int = 2048) -> dict[str, Any]:
    """Measure and predict one configuration on ``cuda:0``."""
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing

    cfg = _gpt_1b()
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()  # the previous row's model and optimizer are garbage by now
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    if checkpoint:
        apply_activation_checkpointing(model, CheckpointPolicy())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        del logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize()
    measured = int(torch.cuda.max_memory_allocated(device))
    inputs = PlanInputs(
        cfg,
        "bf16-mixed",
        StrategyLayout(),
        OPTIMIZER_STATES["adamw"],
        ActivationPolicy(checkpoint_every=1 if checkpoint else 0),
        micro_batch,
        seq_len,
        adam_path="fused",  # the fused kernel: no sqrt temporary
    )
    predicted = estimate_plan(inputs, None, None, None).peak_device_bytes
    return {
        "model": cfg.name,
        "activations": "checkpoint" if checkpoint else "none",
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "predicted": predicted,
        "measured": measured,
        "error": predicted / measured - 1,
    }


def gpu_rows() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        raise SystemExit("bench/planner_gpu.py needs a CUDA device")
    return [gpu_row(checkpoint=c) for c in (False, True)]
