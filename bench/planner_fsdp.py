"""FSDP2's gathered units: the planner's backward-phase FSDP2 terms against what 2 CPU processes (gloo) allocate.

    python bench/planner_fsdp.py                  # one row: predicted, measured, error
    python bench/planner_fsdp.py hf_llama         # the same for a Hugging Face Llama (units from _no_split_modules)
    python bench/planner_fsdp.py measure OUT.json [hf_llama] # the measurement alone: rank 0 writes OUT.json

Measured: the model is sharded by ``parallel.fsdp.apply_fully_shard`` (the blocks, then the rest as the root unit,
exactly as ``+strategy=fsdp`` does under a LightningModule), fp32, AdamW; after two warm-up steps rank 0 records one
forward and backward under ``torch.profiler`` with ``profile_memory``. Counted: allocations made inside FSDP2's own
``FSDP::*`` regions (all-gather outputs, unsharded parameters, reduce-scatter inputs) and the full gradients autograd
writes into the unsharded parameters (the allocations freed in ``FSDP::post_backward_reduce``); left out: the
reduce-scatter outputs (the sharded gradients, which the planner counts as gradients) and allocations inside
``c10d::`` ops (the collective backend's own temporaries). The figure is the peak of those bytes alive at once.
Predicted: the ``FSDP2 ...`` backward terms of ``planner.estimate_model_states`` for the same model; for
``hf_llama`` with the units read from the module (``planner.module_profile``, the block class from
``parallel.fsdp.block_classes``: ``LlamaDecoderLayer``), as ``plan.py model=hf`` plans them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# 4 blocks of 803,328 elements and a 131,328-element root: the units dwarf a 16-token batch's activations.
MODEL = {
    "name": "fsdp_probe",
    "vocab_size": 256,
    "n_layers": 4,
    "d_model": 256,
    "n_heads": 4,
    "ffn_hidden": 704,
    "max_seq_len": 256,
    "tie_embeddings": False,
}
#: The same shape as a Hugging Face Llama (untied head, no GQA here so that its blocks equal MODEL's).
HF_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
WORLD, SEQ = 2, 16


def _hf_model(device: str = "cpu") -> Any:
    import torch
    import transformers

    with torch.device(device):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_LLAMA, use_cache=False))


def _measure(rank: int, port: int, out: str, model: str = "gpt") -> None:
    import torch
    import torch.distributed as dist
    from torch._C._profiler import _EventType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from lightning_trainopt.models import GPT, GPTConfig
    from lightning_trainopt.parallel.fsdp import apply_fully_shard, block_classes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        root = torch.nn.Module()  # stands in for the LightningModule: its child is the root unit
        root.model = GPT(GPTConfig(**MODEL)) if model == "gpt" else _hf_model()
        blocks = ["Block"] if model == "gpt" else block_classes(root)
        apply_fully_shard(root, blocks, init_device_mesh("cpu", (WORLD,)), False, True)
        optimizer = torch.optim.AdamW(root.parameters(), lr=1e-3, foreach=False)
        x = torch.randint(0, MODEL["vocab_size"], (1, SEQ))

        def loss() -> torch.Tensor:
            if model == "gpt":
                return root.model.loss(x, x)
            return root.model(input_ids=x, labels=x).loss

        for _ in range(2):
            loss().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss().backward()
        events: list[tuple[int, int, int, str | None, str | None]] = []

        def walk(nodes: Any, region: str | None, op: str | None) -> None:
            for e in nodes:
                if e.tag == _EventType.Allocation:
                    events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, region, op))
                else:
                    walk(e.children, e.name if e.name.startswith("FSDP::") else region, e.name)

        walk(prof.profiler.kineto_results.experimental_event_tree(), None, None)
        events.sort(key=lambda e: e[0])
        peak = _fsdp_peak(events)
        if rank == 0:
            Path(out).write_text(json.dumps({"fsdp_transient_peak": peak}))
    finally:
        dist.destroy_process_group()


def _fsdp_peak(events: list[tuple[int, int, int, str | None, str | None]]) -> int:
    """Peak bytes alive at once of FSDP2's own transient buffers and the unsharded gradients (see the docstring)."""
    pending: dict[int, int] = {}
    spans: list[list[int | None]] = []  # [allocation index, free index]
    for i, (_, ptr, size, _, _) in enumerate(events):
        if size > 0:
            pending[ptr] = len(spans)
            spans.append([i, None])
        elif ptr in pending:
            spans[pending.pop(ptr)][1] = i
    counted = set()
    for a, f in spans:
        assert a is not None
        _, _, _, region, op = events[a]
        freed_in = events[f][3] if f is not None else None
        if (op or "").startswith("c10d::") or (region is not None and f is None):
            continue
        if region is not None or (freed_in or "").startswith("FSDP::post_backward_reduce"):
            counted.add(a)
    live: dict[int, int] = {}
    now = peak = 0
    for i, (_, ptr, size, _, _) in enumerate(events):
        if size > 0 and i in counted:
            live[ptr] = size
            now += size
        elif size < 0 and ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return peak


def _spawn(out: str, model: str = "gpt") -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_measure, args=(port, out, model), nprocs=WORLD)


def measure(model: str = "gpt") -> int:
    """FSDP2's measured transient peak on rank 0 of a 2-process gloo run (bytes), in a fresh interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fsdp.json"
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "RANK")}
        proc = subprocess.run(
            [sys.executable, __file__, "measure", str(out), model], cwd=tmp, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        if not out.is_file():
            raise RuntimeError(f"the FSDP2 probe produced no measurement:\n{proc.stderr[-3000:]}")
        return int(json.loads(out.read_text())["fsdp_transient_peak"])


def predict_hf() -> int:
    """The FSDP2 backward terms with the units read from the Hugging Face module (as ``plan.py model=hf``)."""
    import torch

    from lightning_trainopt.parallel.fsdp import block_classes
    from lightning_trainopt.planner import (
        OPTIMIZER_STATES,
        StrategyLayout,
        estimate_model_states,
        forward_trace,
        module_profile,
    )

    root = torch.nn.Module()
    root.model = _hf_model()
    x = torch.zeros(1, 8, dtype=torch.long)
    trace = forward_trace(root, lambda: root.model(input_ids=x))
    p = module_profile(root, "hf_llama", _unused, _unused, block_classes(root), trace)  # type: ignore[arg-type]
    est = estimate_model_states(
        p.param_groups, "32-true", StrategyLayout(kind="fsdp"), OPTIMIZER_STATES["adamw"], WORLD,
        module_trace=p.module_trace, fsdp_units=p.fsdp_units,
    )  # fmt: skip
    return sum(t.nbytes for t in est.terms if t.label.startswith("FSDP2") and t.phase == "backward")


def _unused(*_: object) -> object:
    raise AssertionError("only the model states are predicted here")


def predict() -> int:
    from lightning_trainopt.metrics.model_shape import GPTConfig
    from lightning_trainopt.planner import (
        OPTIMIZER_STATES,
        StrategyLayout,
        estimate_model_states,
        gpt_param_groups,
    )
    from lightning_trainopt.planner.fsdp_units import gpt_fsdp_units

    cfg = GPTConfig(**MODEL)
    units = gpt_fsdp_units(
        cfg.vocab_size, cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden, cfg.n_layers, cfg.tie_embeddings
    )
    est = estimate_model_states(
        gpt_param_groups(cfg), "32-true", StrategyLayout(kind="fsdp"), OPTIMIZER_STATES["adamw"], WORLD,
        fsdp_units=units,
    )  # fmt: skip
    return sum(t.nbytes for t in est.terms if t.label.startswith("FSDP2") and t.phase == "backward")


def fsdp_row(model: str = "gpt") -> dict[str, Any]:
    p, m = (predict(), measure()) if model == "gpt" else (predict_hf(), measure(model))
    name = MODEL["name"] if model == "gpt" else model
    return {"model": name, "predicted": p, "measured": m, "error": p / m - 1}


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        _spawn(sys.argv[2], *sys.argv[3:4])
        sys.exit(0)
    row = fsdp_row(*sys.argv[1:2])
    print(f"FSDP2 gathered units, {row['model']}, 2 CPU processes (gloo), fp32:")
    print(f"  predicted {row['predicted']:,} B  measured {row['measured']:,} B  error {row['error']:+.2%}")
