"""The planner's adapter rows against what MemoryBreakdown's accounting reads from a real LoRA / QLoRA model after one
AdamW step (CPU), and the 70B QLoRA case of Answer.AI planned with and without CPU offload.

    python bench/adapter_rows.py
"""

from __future__ import annotations

import torch
import transformers

from lightning_trainopt.metrics.adapter_accounting import ADAPTER_ROWS, adapter_breakdown
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.models.gpt import GPT
from lightning_trainopt.planner import OPTIMIZER_STATES, StrategyLayout
from lightning_trainopt.planner.adapter_targets import module_adapter_plan
from lightning_trainopt.planner.adapters import adapter_model_states
from lightning_trainopt.transforms.adapters import AdapterSpec, apply_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = {
    "frozen_base": ("params", "frozen base: 32-bit"),
    "frozen_base_4bit": ("params", "frozen base: NF4 4-bit"),
    "frozen_base_4bit_scales": ("params", "frozen base: NF4 scales"),
    "adapter_params": ("params", "adapters:"),
    "adapter_grads": ("grads", "adapters:"),
    "adapter_optimizer_states": ("optimizer_states", "adapters:"),
}


def models() -> dict[str, torch.nn.Module]:
    llama = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    return {
        "gpt (d 256, 4 layers)": GPT(GPTConfig(name="g", vocab_size=2048, n_layers=4, d_model=256, n_heads=8)),
        "HF Llama (d 256, 4 layers)": transformers.LlamaForCausalLM(llama),
    }


def main() -> None:
    print("| model | adapter | row | planned B | measured B | planned / measured |")
    print("|---|---|---|---|---|---|")
    for kind in ("lora", "qlora"):
        for name, model in models().items():
            plan = module_adapter_plan(model, kind, 16, TARGETS)
            apply_adapter(model, AdapterSpec(kind=kind, r=16, target_modules=TARGETS, compute_dtype="float32"))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            out = model(torch.randint(0, 2048, (2, 64)))
            (out if isinstance(out, torch.Tensor) else out.logits).float().square().mean().backward()
            grads = adapter_breakdown(model, [opt])["adapter_grads"]
            opt.step()
            measured = {**adapter_breakdown(model, [opt]), "adapter_grads": grads}
            est = adapter_model_states(plan, "32-true", StrategyLayout(), OPTIMIZER_STATES["adamw"], 1)
            for row in ADAPTER_ROWS:
                cat, prefix = PREFIX[row]
                want = sum(
                    t.nbytes
                    for t in est.terms
                    if t.category == cat and t.label.startswith(prefix) and t.phase != "build"
                )
                got = measured[row]
                ratio = f"{want / got:.4f}" if got else "-"
                print(f"| {name} | {kind} | {row} | {want:,} | {got:,} | {ratio} |")


if __name__ == "__main__":
    main()
