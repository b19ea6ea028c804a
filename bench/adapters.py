"""Full fine-tuning vs LoRA vs QLoRA, side by side in one process: parameters, optimizer-state bytes, base weight bytes,
step time and loss after N steps.

    python bench/adapters.py                          # gpt_125m and a tiny Hugging Face Llama, 8 steps each
    python bench/adapters.py --models hf_llama --steps 30 --device cuda

Each variant starts from the same weights (same seed) and trains on the same batches (byte tokens of Python's own
standard library) with AdamW (lr 1e-3) over the parameters that require
grad, as ``models/optimization.py`` builds it. bf16 autocast. Measured, not estimated:

- ``trainable``: parameters that require grad; ``opt state``: bytes of the optimizer's state tensors after step 1;
- ``adapted base``: bytes of the targeted layers' weights in bf16 (full, LoRA) or as QLoRA stores them (packed
  4-bit + absmax + nested scales + code books), and ``model``: every parameter and buffer as the run holds them (fp32
  except QLoRA's packed layers);
- ``step ms``: median wall time of a training step after 2 warm-up steps; ``loss``: the training loss at the last step.

A last table compares bitsandbytes' ``Linear4bit`` with torchao's ``NF4Tensor`` on one gpt_125m MLP layer (bytes and
a forward + backward through the frozen 4-bit weight).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_trainopt.models import GPT, GPTConfig  # noqa: E402
from lightning_trainopt.models.optimization import decay_param_groups  # noqa: E402
from lightning_trainopt.transforms.adapters import AdapterSpec, apply_adapter, default_target_modules  # noqa: E402

GPT_125M = GPTConfig(
    vocab_size=50304, n_layers=12, d_model=768, n_heads=12, ffn_hidden=2048, max_seq_len=2048, tie_embeddings=True
)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt_125m":
        return GPT(GPT_125M)
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(cfg)


def _batches(n: int, batch: int, seq: int) -> list[torch.Tensor]:
    import sysconfig

    text = b"".join(p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40])
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    step = batch * (seq + 1)
    return [tokens[i * step : (i + 1) * step].view(batch, seq + 1) for i in range(n)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    inputs, targets = x[:, :-1], x[:, 1:]
    logits = model(inputs) if isinstance(model, GPT) else model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _targeted(model: torch.nn.Module) -> list[str]:
    """Names of the linear layers LoRA adapts by default (what QLoRA quantizes)."""
    targets = default_target_modules(model)
    return [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets and hasattr(m, "weight")]


def _base_bytes(model: torch.nn.Module, names: list[str]) -> int:
    """Bytes of the targeted layers' frozen weights: bf16 (2 bytes a weight) for a plain layer; for a 4-bit layer the
    packed weight plus its quantization state (absmax or its 8-bit nesting with nested absmax and code, code book)."""
    modules = dict(model.named_modules())
    total = 0
    for name in names:
        weight = getattr(modules[name], "base_layer", modules[name]).weight
        state = getattr(weight, "quant_state", None)
        if state is None:
            total += weight.numel() * 2
        else:
            total += _tensor_bytes(weight) + sum(_tensor_bytes(v) for v in state.as_dict(packed=True).values())
    return total


def run_variant(name: str, kind: str, steps: int, device: str, batch: int, seq: int) -> dict[str, Any]:
    """One variant (``full``, ``lora``, ``qlora``) of model ``name``: fp32 trainable weights under bf16 autocast."""
    model = _model(name)
    names = _targeted(model)
    if kind != "full":
        apply_adapter(model, AdapterSpec(kind=kind, r=16, alpha=32, dropout=0.05))  # type: ignore[arg-type]
    model.to(device)
    opt = torch.optim.AdamW(decay_param_groups(model.parameters()), lr=1e-3)
    times, losses, state_bytes = [], [], 0
    for i, x in enumerate(_batches(steps, batch, seq)):
        x = x.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = _loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if i == 0:
            state_bytes = sum(_tensor_bytes(v) for s in opt.state.values() for v in s.values())
    model_bytes = sum(_tensor_bytes(p) for p in model.parameters()) + sum(_tensor_bytes(b) for b in model.buffers())
    return {
        "model": name,
        "kind": kind,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "state_bytes": state_bytes,
        "base_bytes": _base_bytes(model, names),
        "model_bytes": model_bytes,
        "step_ms": 1000 * statistics.median(times[2:] or times),
        "first_loss": losses[0],
        "loss": losses[-1],
    }


def nf4_layer(device: str) -> list[dict[str, Any]]:
    """bitsandbytes ``Linear4bit`` vs torchao ``NF4Tensor`` on one gpt_125m MLP layer (2048 x 768, bf16 input)."""
    import bitsandbytes as bnb
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    torch.manual_seed(0)
    weight = torch.randn(2048, 768, dtype=torch.bfloat16, device=device) * 0.02
    x = torch.randn(8 * 128, 768, dtype=torch.bfloat16, device=device, requires_grad=True)
    rows = []
    layer = bnb.nn.Linear4bit(
        768, 2048, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=torch.bfloat16
    )
    layer.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16)
    layer = layer.to(device)
    layer.support_avx512bf16_for_cpu = False
    state = layer.weight.quant_state.as_dict(packed=True)
    nbytes = _tensor_bytes(layer.weight) + sum(_tensor_bytes(v) for v in state.values())
    rows.append({"impl": "bitsandbytes Linear4bit", "bytes": nbytes, "ms": _time(lambda: layer(x), x, device)})
    nf4 = to_nf4(weight)
    nbytes = sum(_tensor_bytes(getattr(nf4, a)) for a in nf4.__tensor_flatten__()[0])
    rows.append({"impl": "torchao NF4Tensor", "bytes": nbytes, "ms": _time(lambda: linear_nf4(x, nf4), x, device)})
    rows.append(
        {
            "impl": "bf16 weight (reference)",
            "bytes": _tensor_bytes(weight),
            "ms": _time(lambda: x @ weight.t(), x, device),
        }
    )
    return rows


def _time(fn: Any, x: torch.Tensor, device: str, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn().float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        x.grad = None
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt_125m", "hf_llama"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(
        f"| model | variant | trainable | opt state (B) | vs full | adapted base (B) | vs bf16 | model (B) | step ms "
        f"| loss step 1 -> {args.steps} |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        rows = [
            run_variant(name, kind, args.steps, args.device, args.batch, args.seq) for kind in ("full", "lora", "qlora")
        ]
        full = rows[0]
        for r in rows:
            print(
                f"| {name} | {r['kind']} | {r['trainable']:,} | {r['state_bytes']:,} | "
                f"{r['state_bytes'] / full['state_bytes']:.2%} | {r['base_bytes']:,} | "
                f"{r['base_bytes'] / full['base_bytes']:.3f}x | {r['model_bytes']:,} | {r['step_ms']:.0f} | "
                f"{r['first_loss']:.3f} -> {r['loss']:.3f} |",
                flush=True,
            )
    print("\n| 4-bit layer (2048 x 768) | bytes | fwd+bwd ms |\n|---|---:|---:|")
    for r in nf4_layer(args.device):
        print(f"| {r['impl']} | {r['bytes']:,} | {r['ms']:.2f} |")


if __name__ == "__main__":
    main()
