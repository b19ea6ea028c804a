"""Planner accuracy: predicted vs measured bytes.

    python bench/planner_accuracy.py activations      # saved-for-backward bytes, CPU, seconds
    python bench/planner_accuracy.py activations --models  # the same for a Hugging Face Llama config and a user module
    python bench/planner_accuracy.py activations --fp8     # precision=fp8 (torchao, emulated) and loss=chunked_ce, CPU
    python bench/planner_accuracy.py gpu --fp8             # the same on one CUDA device (real FP8) vs hardware=h200
    python bench/planner_accuracy.py states           # per-rank model states, 2 CPU processes x ddp/zero1/zero2/zero3
    python bench/planner_accuracy.py states --models  # the same for a Hugging Face Llama config and a user module
    python bench/planner_accuracy.py gpu              # gpt_1b bf16 peak vs torch.cuda.max_memory_allocated (CUDA)

Each mode prints a table (predicted, measured, error) and exits non-zero when a row misses its target
(model states 5%, activations 10%, GPU peak 10%).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter, transform_saved_tensors  # noqa: E402
from lightning_trainopt.models import GPT, GPTConfig  # noqa: E402
from lightning_trainopt.planner import ActivationPolicy, estimate_transformer_activations  # noqa: E402

DEMO = GPTConfig(name="demo", vocab_size=256, n_layers=4, d_model=128, n_heads=4, ffn_hidden=352, max_seq_len=512)
GQA = GPTConfig(
    name="demo_gqa", vocab_size=256, n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=352, max_seq_len=512
)
PRECISIONS = {
    "fp32": ("32-true", torch.float32, False),
    "bf16-mixed": ("bf16-mixed", torch.float32, True),
    "bf16-true": ("bf16-true", torch.bfloat16, False),
}
POLICIES = {
    "none": ActivationPolicy(),
    "checkpoint": ActivationPolicy(1),
    "checkpoint_every_2nd": ActivationPolicy(2),
    "int8": ActivationPolicy(compress_bits=8),
}


def measure_activations(cfg: GPTConfig, precision: str, policy_name: str, micro_batch: int, seq_len: int) -> int:
    """Saved-for-backward bytes of one real CPU forward, counted by metrics.saved_tensors with the real techniques."""
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing
    from lightning_trainopt.transforms.compression import Int8Compressor

    _, dtype, autocast = PRECISIONS[precision]
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    policy = POLICIES[policy_name]
    if policy.checkpoint_every:
        apply_activation_checkpointing(model, CheckpointPolicy(every_k=policy.checkpoint_every))
    x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    compressor = Int8Compressor() if policy.compress_bits else None
    with SavedTensorsCounter(params=model.parameters()) as counter:
        if compressor is not None:
            with transform_saved_tensors(compressor):
                loss = _loss(model, x, y, autocast)
        else:
            loss = _loss(model, x, y, autocast)
    loss.backward()
    return counter.report().activation_bytes


def _loss(model: GPT, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    # The loss exactly as LitGPT._loss computes it.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def predict_activations(cfg: GPTConfig, precision: str, policy_name: str, micro_batch: int, seq_len: int) -> int:
    tp, _, autocast = PRECISIONS[precision]
    est = estimate_transformer_activations(
        cfg, micro_batch, seq_len, 4 if tp == "32-true" else 2, autocast, POLICIES[policy_name]
    )
    return est.bytes("activations")


def measure_module_activations(model: str, precision: str, policy_name: str, micro_batch: int, seq_len: int) -> int:
    """Saved-for-backward bytes of one real CPU training step of a module planned from itself (``hf_llama``,
    ``user``: see ``planner_states``), with the real techniques."""
    from bench.planner_states import build_module
    from lightning_trainopt.config.plan_model import token_dict_batch, training_loss
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing
    from lightning_trainopt.transforms.compression import Int8Compressor

    _, dtype, autocast = PRECISIONS[precision]
    torch.manual_seed(0)
    module = build_module(model)
    module.configure_model()
    module = module.to(dtype)
    policy = POLICIES[policy_name]
    if policy.checkpoint_every:
        apply_activation_checkpointing(module, CheckpointPolicy(every_k=policy.checkpoint_every))
    x, y = (torch.randint(0, 256, (micro_batch, seq_len)) for _ in range(2))
    # The batch each trains on: our data's (x, y) for the Hugging Face model, UserLM's dict of whole rows.
    batch: Any = (x, y)
    if model != "hf_llama":
        batch = {**token_dict_batch(micro_batch, seq_len), "input_ids": x, "labels": y}
    compressor = Int8Compressor() if policy.compress_bits else None
    with (
        SavedTensorsCounter(params=module.parameters()) as counter,
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        if compressor is not None:
            with transform_saved_tensors(compressor):
                training_loss(module, batch)
        else:
            training_loss(module, batch)
    return counter.report().activation_bytes


def predict_module_activations(profile: Any, precision: str, policy_name: str, micro_batch: int, seq_len: int) -> int:
    """The planner's activation bytes of a profile read from the module (``planner_states.profile``)."""
    tp, _, autocast = PRECISIONS[precision]
    compute_bytes = 4 if tp == "32-true" else 2
    est = profile.activations(micro_batch, seq_len, compute_bytes, autocast, POLICIES[policy_name], "sdpa")
    return est.bytes("activations")


def module_activation_rows(quick: bool = False) -> list[dict[str, Any]]:
    from bench.planner_states import profile

    shapes = [(2, 64)] if quick else [(1, 64), (4, 128), (2, 512)]
    rows = []
    for model in ("hf_llama", "user"):
        planned = profile(model)
        for precision in PRECISIONS:
            for pol in POLICIES:
                for mb, t in shapes:
                    pred = predict_module_activations(planned, precision, pol, mb, t)
                    meas = measure_module_activations(model, precision, pol, mb, t)
                    rows.append(
                        {
                            "model": model,
                            "precision": precision,
                            "activations": pol,
                            "micro_batch": mb,
                            "seq_len": t,
                            "predicted": pred,
                            "measured": meas,
                            "error": pred / meas - 1,
                        }
                    )
    return rows


def activation_rows(quick: bool = False) -> list[dict[str, Any]]:
    shapes = [(2, 64), (8, 128)] if quick else [(1, 64), (4, 128), (8, 256), (2, 512)]
    rows = []
    for cfg in [DEMO] if quick else [DEMO, GQA]:
        for precision in ["fp32", "bf16-mixed"] if quick else list(PRECISIONS):
            for pol in POLICIES:
                for mb, t in shapes:
                    pred = predict_activations(cfg, precision, pol, mb, t)
                    meas = measure_activations(cfg, precision, pol, mb, t)
                    rows.append(
                        {
                            "model": cfg.name,
                            "precision": precision,
                            "activations": pol,
                            "micro_batch": mb,
                            "seq_len": t,
                            "predicted": pred,
                            "measured": meas,
                            "error": pred / meas - 1,
                        }
                    )
    return rows


# Every linear layer divisible by 16, so that precision.skip_small=false converts all but the head.
FP8_CFG = GPTConfig(
    name="demo_fp8", vocab_size=512, n_layers=2, d_model=256, n_heads=4, ffn_hidden=688, max_seq_len=512
)


def _plan_cfg(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "lightning_trainopt" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return compose("plan", overrides=overrides)


def _demo_overrides(cfg: GPTConfig, hardware: str = "cpu") -> list[str]:
    keys = ("vocab_size", "n_layers", "d_model", "n_heads", "ffn_hidden", "max_seq_len")
    return ["model=gpt_tiny", f"hardware={hardware}", *(f"model.{k}={getattr(cfg, k)}" for k in keys)]


def predict_variant(
    precision: str, loss: str, policy_name: str, micro_batch: int, seq_len: int, hardware: str = "cpu"
) -> int:
    """The planner's activation bytes (``plan(cfg)`` on ``hardware``: ``cpu`` emulates FP8, a GPU preset plans real
    FP8 GEMMs) for ``precision=fp8`` (torchao, every layer divisible by 16 converted), ``bf16``, or
    ``bf16_keep_fp32`` (bf16 with ``keep_fp32=[RMSNorm, lm_head]``), with ``loss=standard`` or ``chunked_ce``."""
    from lightning_trainopt.config.plan import plan

    overrides = [
        *_demo_overrides(FP8_CFG, hardware),
        f"precision={precision}",
        f"loss={loss}",
        f"activations={policy_name}",
        f"data.batch_size={micro_batch}",
        f"data.seq_len={seq_len}",
        "loss.chunk_tokens=128" if loss == "chunked_ce" else "plan.top_k=10",
    ]
    if precision == "fp8":
        overrides.append("precision.skip_small=false")
    if precision == "bf16_keep_fp32":  # bf16 with the head and every RMSNorm kept in fp32
        overrides[overrides.index(f"precision={precision}")] = "precision=bf16"
        overrides.append("+precision.keep_fp32=[RMSNorm,lm_head]")
    est = plan(_plan_cfg(overrides)).estimate
    return est.memory.bytes("activations")


def measure_variant(
    precision: str, loss: str, policy_name: str, micro_batch: int, seq_len: int, device: str = "cpu"
) -> int:
    """Saved-for-backward bytes of one real training step of the same model as ``train.py`` runs it: ``LitGPT``
    with ``loss=chunked_ce``'s ``ChunkedLMHeadLoss`` (computed inside the head's call), the precision plugin's
    conversion (``precision.convert.convert_model``: torchao emulated on CPU, real FP8 GEMMs on CUDA; fp32-kept
    modules), checkpointing, and its ``training_step`` under bf16 autocast, on ``device``."""
    from lightning_trainopt.config.plan_model import training_loss
    from lightning_trainopt.models import LitGPT
    from lightning_trainopt.precision import FP8PrecisionSpec, PrecisionSpec, convert_model
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing
    from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss

    torch.manual_seed(0)
    module = LitGPT(FP8_CFG, loss=ChunkedLMHeadLoss(128) if loss == "chunked_ce" else None)
    module.configure_model()
    module.to(device)
    if precision == "fp8":
        spec = FP8PrecisionSpec(name="fp8", trainer_precision="bf16-mixed", skip_small=False)
        convert_model(module, spec, emulate=device == "cpu", fsdp=False)
    if precision == "bf16_keep_fp32":
        kept = PrecisionSpec(name="bf16", trainer_precision="bf16-mixed", keep_fp32=["RMSNorm", "lm_head"])
        convert_model(module, kept, emulate=False, fsdp=False)
    policy = POLICIES[policy_name]
    if policy.checkpoint_every:
        apply_activation_checkpointing(module, CheckpointPolicy(every_k=policy.checkpoint_every))
    x = torch.randint(0, FP8_CFG.vocab_size, (micro_batch, seq_len), device=device)
    y = torch.randint(0, FP8_CFG.vocab_size, (micro_batch, seq_len), device=device)
    with (
        SavedTensorsCounter(params=module.parameters()) as counter,
        torch.autocast(device, dtype=torch.bfloat16),
    ):
        out = training_loss(module, (x, y))
    out.backward()
    return counter.report().activation_bytes


def gpu_variant_rows(hardware: str = "h200") -> list[dict[str, Any]]:
    """The FP8 and chunked-loss rows on one CUDA device against ``plan(cfg)`` for ``hardware`` (written for a GPU
    session: the planner's view of ``Float8Linear`` under CUDA autocast, bf16 inputs saved, is checked here)."""
    rows = []
    for precision, loss in (("bf16", "standard"), ("fp8", "standard"), ("fp8", "chunked_ce")):
        for pol in ("none", "checkpoint"):
            pred = predict_variant(precision, loss, pol, 4, 256, hardware)
            meas = measure_variant(precision, loss, pol, 4, 256, "cuda")
            rows.append(
                {
                    "model": FP8_CFG.name,
                    "precision": precision,
                    "loss": loss,
                    "activations": pol,
                    "micro_batch": 4,
                    "seq_len": 256,
                    "predicted": pred,
                    "measured": meas,
                    "error": pred / meas - 1,
                }
            )
    return rows


def predict_hf_chunked(policy_name: str, micro_batch: int, seq_len: int) -> int:
    """``plan(cfg)`` of the Hugging Face Llama config (``planner_states.HF_LLAMA``) with ``loss=chunked_ce``,
    ``bf16``, on ``hardware=cpu``: measured on fake tensors with the chunked loss on its head."""
    from bench.planner_states import hf_config_dir
    from lightning_trainopt.config.plan import plan

    overrides = [
        "model=hf",
        f"model.config={hf_config_dir()}",
        "hardware=cpu",
        "precision=bf16",
        "loss=chunked_ce",
        "loss.chunk_tokens=128",
        f"activations={policy_name}",
        f"data.batch_size={micro_batch}",
        f"data.seq_len={seq_len}",
    ]
    return plan(_plan_cfg(overrides)).estimate.memory.bytes("activations")


def measure_hf_chunked(policy_name: str, micro_batch: int, seq_len: int) -> int:
    """One real CPU training step of ``LitCausalLM`` with ``ChunkedLMHeadLoss`` as its head loss, under bf16
    autocast, on our data's ``(x, y)`` batch."""
    from bench.planner_states import build_module
    from lightning_trainopt.config.plan_model import training_loss
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing
    from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss

    torch.manual_seed(0)
    module = build_module("hf_llama")
    module.head_loss = ChunkedLMHeadLoss(128)
    module.configure_model()
    policy = POLICIES[policy_name]
    if policy.checkpoint_every:
        apply_activation_checkpointing(module, CheckpointPolicy(every_k=policy.checkpoint_every))
    x, y = (torch.randint(0, 256, (micro_batch, seq_len)) for _ in range(2))
    with (
        SavedTensorsCounter(params=module.parameters()) as counter,
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        out = training_loss(module, (x, y))
    out.backward()
    return counter.report().activation_bytes


def variant_rows(quick: bool = False) -> list[dict[str, Any]]:
    cases = [
        ("bf16", "standard"),
        ("fp8", "standard"),
        ("bf16", "chunked_ce"),
        ("fp8", "chunked_ce"),
        ("bf16_keep_fp32", "standard"),
    ]
    policies = ["none"] if quick else ["none", "checkpoint"]
    shapes = [(2, 128)] if quick else [(2, 128), (4, 256)]
    rows = []
    for precision, loss in cases:
        for pol in policies:
            for mb, t in shapes:
                pred = predict_variant(precision, loss, pol, mb, t)
                meas = measure_variant(precision, loss, pol, mb, t)
                rows.append(
                    {
                        "model": FP8_CFG.name,
                        "precision": precision,
                        "loss": loss,
                        "activations": pol,
                        "micro_batch": mb,
                        "seq_len": t,
                        "predicted": pred,
                        "measured": meas,
                        "error": pred / meas - 1,
                    }
                )
    for pol in policies:
        for mb, t in shapes:
            pred = predict_hf_chunked(pol, mb, t)
            meas = measure_hf_chunked(pol, mb, t)
            rows.append(
                {
                    "model": "hf_llama",
                    "precision": "bf16",
                    "loss": "chunked_ce",
                    "activations": pol,
                    "micro_batch": mb,
                    "seq_len": t,
                    "predicted": pred,
                    "measured": meas,
                    "error": pred / meas - 1,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["activations", "states", "gpu"])
    parser.add_argument("--quick", action="store_true", help="fewer rows (the test suite's setting)")
    parser.add_argument(
        "--models", action="store_true", help="a Hugging Face Llama config and a user module instead of our model"
    )
    parser.add_argument("--fp8", action="store_true", help="precision=fp8 (emulated) and loss=chunked_ce on our model")
    args = parser.parse_args()
    if args.mode == "activations" and args.fp8:
        _print(variant_rows(args.quick), ["model", "precision", "loss", "activations", "micro_batch", "seq_len"], 0.10)
    elif args.mode == "activations":
        rows = module_activation_rows(args.quick) if args.models else activation_rows(args.quick)
        _print(rows, ["model", "precision", "activations", "micro_batch", "seq_len"], 0.10)
    elif args.mode == "states":
        from bench.planner_states import model_states_rows, states_rows  # noqa: PLC0415

        rows = model_states_rows() if args.models else states_rows()
        _print(rows, ["model", "strategy", "precision", "category"], 0.05)
    elif args.fp8:
        _print(gpu_variant_rows(), ["model", "precision", "loss", "activations", "micro_batch", "seq_len"], 0.10)
    else:
        from bench.planner_gpu import gpu_rows  # noqa: PLC0415

        _print(gpu_rows(), ["model", "activations", "micro_batch", "seq_len"], 0.10)


def _print(rows: list[dict[str, Any]], keys: list[str], tol: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"planner accuracy (target |error| <= {tol:.0%})")
    for k in [*keys, "predicted", "measured", "error"]:
        table.add_column(k, justify="right")
    bad = 0
    for r in rows:
        ok = abs(r["error"]) <= tol
        bad += not ok
        table.add_row(
            *[str(r[k]) for k in keys],
            f"{r['predicted']:,}",
            f"{r['measured']:,}",
            f"{'' if ok else '[red]'}{r['error']:+.2%}",
        )
    Console(width=160).print(table)
    print(f"{len(rows) - bad}/{len(rows)} rows within {tol:.0%}")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
