"""One rank of a real tensor-parallel run on CPU (gloo), started by torch.distributed.run with 2 or 4 processes.

2 processes: TP 2. 4 processes: a 2 x 2 mesh (FSDP2 over 2 data-parallel ranks x TP 2), and a Lightning fit with
HSDP (replicate=2 x shard 1 x TP 2, the 3-D mesh). Each rank writes what it measured to ``OUT_DIR/rank<r>.json``
for tests/unit/parallel/test_tp.py:

* ``raw``: for our GPT and a tiny Hugging Face Llama, the losses of the parallel model and of a whole model trained
  on the same global batch (what DDP computes), step by step, with gradient clipping over a mix of DTensor and
  plain parameters (an extra plain layer), and the parameter elements this rank holds against the whole model's;
* ``walk``: each OK cell of the ``tp`` and ``fsdp_tp`` columns of the technique x strategy table, applied by
  ``apply_rewrites`` (conversions, TP, activation techniques) to our GPT, ``fully_shard``-ed over the
  data-parallel ranks for ``fsdp_tp``: the loss and gradients of one forward and backward against a whole model's
  (FP8: the whole model converted the same way; the float8 matmuls torchao ran and their local weight shapes; int8:
  the storages compressed and the bytes kept by dtype), then a forward without grad (as validation runs); and FP8
  with sequence parallelism refused on gloo;
* ``meta`` (4 processes): our GPT and a tiny Hugging Face Llama (tied embeddings) built on the meta device, split
  by TP 2 x FSDP2 2 and materialised piece by piece, against a whole build from the same seed (every weight, whole
  again through ``full_tensor``); and a ``save_pretrained`` Llama read slice by slice against ``from_pretrained``
  (weights, logits, and the elements this rank read);
* ``hf_split``: tiny Hugging Face Llama, Mistral and Qwen2 split by TP 2: their configs and the elements this rank
  holds (the planner's per-rank count is checked against them);
* ``chunked``, ``chunked_hf``: ``loss=chunked_ce`` on the vocabulary-sharded head (the ``chunked_ce`` cell of ``tp``
  and ``fsdp_tp``) of our GPT and of a tiny Hugging Face Llama against the loss-parallel cross-entropy: the loss and
  each gradient;
* ``fit``: a Lightning fit with ``TrainOptTPStrategy`` (built on the meta device): ParallelDims, the sampler's
  sharding, the batches read, the logged losses, and the global gradient norm Lightning clipped to;
* ``lora`` (4 processes): ``adapter=lora`` under TP 2 x FSDP2 2 (and HSDP 2 x 1) against a one-process replay
  (:func:`lora`);
* ``distill`` (4 processes): ``experiment=distill`` under TP 2 x FSDP2 2 (:func:`distill`).

Usage: python -m torch.distributed.run --standalone --nproc_per_node=N tests/unit/parallel/_tp_worker.py OUT_DIR

With a second argument ``nccl`` (2 GPUs): ``fp8_nccl`` only, FP8 with sequence parallelism (float8 all-gathers).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_trainopt.exceptions import IncompatibleConfigError  # noqa: E402
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter  # noqa: E402
from lightning_trainopt.models.config import GPTConfig  # noqa: E402
from lightning_trainopt.models.gpt import GPT  # noqa: E402
from lightning_trainopt.models.lit_gpt import LitGPT  # noqa: E402
from lightning_trainopt.parallel.apply import RewritePlan, apply_fully_shard, apply_rewrites  # noqa: E402
from lightning_trainopt.parallel.compat_table import TABLE, TECHNIQUES  # noqa: E402
from lightning_trainopt.parallel.dims import ParallelDims  # noqa: E402
from lightning_trainopt.parallel.tp import apply_tensor_parallel, clip_grad_norm_  # noqa: E402
from lightning_trainopt.parallel.tp_strategy import TrainOptTPStrategy  # noqa: E402
from lightning_trainopt.precision.convert import convert_model  # noqa: E402
from lightning_trainopt.precision.fp8_spec import FP8PrecisionSpec  # noqa: E402
from lightning_trainopt.precision.spec import PrecisionSpec  # noqa: E402
from lightning_trainopt.transforms.adapters import AdapterSpec  # noqa: E402
from lightning_trainopt.transforms.checkpointing import CheckpointPolicy  # noqa: E402
from lightning_trainopt.transforms.chunked_loss import ChunkedLMHeadLoss, head_returns_loss  # noqa: E402
from lightning_trainopt.transforms.compression import Int8Compressor, gradient_relative_error  # noqa: E402
from lightning_trainopt.transforms.offload import CpuOffloader  # noqa: E402
from tests.helpers.tiny_fit import tiny_data  # noqa: E402

VOCAB, SEQ, STEPS, CLIP = 64, 16, 4, 0.5
SHAPE = GPTConfig(
    name="tp-test", vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ
)


class Holder(nn.Module):
    """Holds the model as a LightningModule does (FSDP2 shards the blocks, then the model as one unit)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _hf_llama(tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        tie_word_embeddings=tied,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


def _loss(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if kind == "hf":
        return model(x, labels=x).loss
    logits = model(x)
    return nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), torch.roll(x, -1, 1).reshape(-1))


def _elements(model: nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def raw(kind: str, dims: ParallelDims, rank: int) -> dict[str, Any]:
    """TP (and FSDP2 over the data-parallel ranks) against a whole model on the whole global batch."""
    mesh = init_device_mesh("cpu", (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    whole = GPT(SHAPE) if kind == "gpt" else _hf_llama()
    extra = nn.Linear(4, 4)  # a plain parameter beside the DTensors, for the clipping
    model, model_extra = copy.deepcopy(whole), copy.deepcopy(extra)
    apply_tensor_parallel(model, mesh["tp"])
    local_after_tp = _elements(model)
    if dims.dp > 1:
        block = "Block" if kind == "gpt" else "LlamaDecoderLayer"
        # As the app shards a LightningModule: the blocks, then the model (a tied embedding and head) as one unit.
        holder = Holder(model)
        apply_fully_shard(holder, [block], mesh["dp"], cpu_offload=False, reshard_after_forward=True)
    opt_whole = torch.optim.AdamW([*whole.parameters(), *extra.parameters()], lr=1e-2)
    opt = torch.optim.AdamW([*model.parameters(), *model_extra.parameters()], lr=1e-2)
    probe = torch.ones(2, 4)
    losses, whole_losses, norms, whole_norms = [], [], [], []
    dp_rank = dims.dp_rank(rank)
    for step in range(STEPS):
        batch = torch.randint(0, VOCAB, (2 * dims.dp, SEQ), generator=torch.Generator().manual_seed(step))
        loss = _loss(kind, whole, batch) + 1e-3 * extra(probe).pow(2).sum()
        loss.backward()
        whole_norms.append(float(torch.nn.utils.clip_grad_norm_([*whole.parameters(), *extra.parameters()], CLIP)))
        opt_whole.step()
        opt_whole.zero_grad()
        whole_losses.append(float(loss))
        mine = batch[2 * dp_rank : 2 * dp_rank + 2]  # this data-parallel rank's half; a TP group reads the same
        with loss_parallel():
            part = _loss(kind, model, mine)
            part = part.full_tensor() if isinstance(part, DTensor) else part
            # FSDP2 averages the gradients of the data-parallel ranks' halves: the whole batch's mean loss.
            penalty = 1e-3 * model_extra(probe).pow(2).sum()
            (part + penalty).backward()
        norms.append(float(clip_grad_norm_([*model.parameters(), *model_extra.parameters()], CLIP)))
        opt.step()
        opt.zero_grad()
        mean = part.detach().clone()
        dist.all_reduce(mean)  # every rank of a tensor-parallel group holds its replica's loss
        losses.append(float(mean) / dims.world_size + float(penalty.detach()))
    norm_numel = sum(p.numel() for n, p in whole.named_parameters() if p.dim() == 1)
    return {
        "losses": losses,
        "whole_losses": whole_losses,
        "norms": norms,
        "whole_norms": whole_norms,
        "whole_elements": sum(p.numel() for p in whole.parameters()),
        "norm_elements": norm_numel,
        "local_elements_tp": local_after_tp,
    }


def hf_split(dims: ParallelDims) -> dict[str, Any]:
    """Tiny Llama (GQA, untied head), Mistral (tied) and Qwen2 (q/k/v biases) split by TP 2: each config and the
    parameter elements this rank holds, against which the planner's per-rank count is checked (test_tp.py)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    mesh = init_device_mesh("cpu", (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    small = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    small.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    builds = {
        "llama": _hf_llama,
        "mistral": lambda: MistralForCausalLM(MistralConfig(**small, tie_word_embeddings=True)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**small, tie_word_embeddings=False)),
    }
    got = {}
    for name, build in builds.items():
        model = build()
        apply_tensor_parallel(model, mesh["tp"])
        got[name] = {"config": json.loads(model.config.to_json_string()), "local_elements": _elements(model)}
    return got


def chunked(dims: ParallelDims, kind: str = "gpt") -> dict[str, Any]:
    """``loss=chunked_ce`` on the vocabulary-sharded head against the loss-parallel cross-entropy of the same model:
    the loss and every gradient (this rank's shard), 5 tokens per chunk (ragged: 2 x 16 tokens), some targets ignored,
    fully_shard-ed over the data-parallel ranks on the 2 x 2 mesh. ``kind="hf"``: a tiny Hugging Face Llama, its loss
    computed where its forward computes the logits, as ``models/hf.py`` runs ``loss=chunked_ce``."""
    mesh = init_device_mesh("cpu", (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(SHAPE) if kind == "gpt" else _hf_llama()
    apply_tensor_parallel(model, mesh["tp"])
    if dims.dp > 1:
        block = "Block" if kind == "gpt" else "LlamaDecoderLayer"
        apply_fully_shard(Holder(model), [block], mesh["dp"], cpu_offload=False, reshard_after_forward=True)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    y = torch.roll(x, -1, 1)
    y[0, :3] = -100  # padding that does not count

    def forward() -> Any:
        return model(x) if kind == "gpt" else model(input_ids=x, use_cache=False).logits

    with loss_parallel():
        logits = forward()
        standard = nn.functional.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1), ignore_index=-100)
        standard = standard.full_tensor() if isinstance(standard, DTensor) else standard
        standard.backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with loss_parallel(), head_returns_loss(model.lm_head, ChunkedLMHeadLoss(chunk_tokens=5), y):
        loss = forward()
        loss.backward()
    plain = not isinstance(loss, DTensor)
    diffs = {n: float((p.grad.to_local() - grads[n]).abs().max()) for n, p in model.named_parameters()}
    scale = max(float(g.abs().max()) for g in grads.values())
    out = {"standard": float(standard.detach()), "chunked": float(loss.detach()), "plain": plain}
    return {**out, "grad_diffs": diffs, "scale": scale}


#: FP8 as conf/precision/fp8.yaml (tensorwise), every linear layer of the tiny model converted, emulated on CPU.
FP8 = FP8PrecisionSpec(name="fp8", trainer_precision="bf16-mixed", recipe="tensorwise", skip_small=False)


def _technique_plan(technique: str) -> RewritePlan:
    plans = {
        # Without sequence parallelism no float8 tensor crosses a collective: it runs on gloo.
        "fp8": RewritePlan(precision=FP8, emulate_fp8=True, sequence_parallel=False),
        "int8": RewritePlan(saved_tensors=Int8Compressor(min_numel=1)),
        # aot_eager: Dynamo and AOTAutograd's DTensor handling (where TP once failed) without Inductor's code
        # generation, which is slow on 4 processes sharing 2 cores.
        "compile": RewritePlan(compile=True, compile_kwargs={"backend": "aot_eager"}),
        "keep_fp32": RewritePlan(
            precision=PrecisionSpec(name="bf16", trainer_precision="bf16-mixed", keep_fp32=("RMSNorm",))
        ),
        "checkpoint": RewritePlan(checkpoint=CheckpointPolicy()),
        "offload": RewritePlan(saved_tensors=CpuOffloader(pin_memory=False, min_numel=1)),
    }
    return RewritePlan(**{**plans[technique].__dict__, "tensor_parallel": 2})


@contextmanager
def _float8_mms() -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the weights of every matmul torchao's float8 tensor computed (its ``aten.mm`` override)."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    seen: list[tuple[int, ...]] = []
    mm = torch.ops.aten.mm.default
    own = FLOAT8_OPS_TABLE[mm]

    def counting(op: Any, args: Any, kwargs: Any = None) -> Any:
        seen.append(tuple(args[1].shape))
        return own(op, args, kwargs)

    FLOAT8_OPS_TABLE[mm] = counting
    try:
        yield seen
    finally:
        FLOAT8_OPS_TABLE[mm] = own


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def walk(dims: ParallelDims) -> dict[str, Any]:
    """Every OK cell of the tp and fsdp_tp columns: one forward and backward against a whole model's loss and
    gradients (the whole model FP8-converted too for the fp8 cells), then a forward without grad."""
    mesh = init_device_mesh("cpu", (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    batch = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    got: dict[str, Any] = {}
    for family in ("tp", "fsdp_tp"):
        for technique in (t for t in TECHNIQUES if TABLE[t][family] is None and t != "chunked_ce"):
            cell = f"{technique}+{family}"
            try:
                torch.manual_seed(0)
                whole = GPT(SHAPE)
                holder = Holder(copy.deepcopy(whole))
                plan = _technique_plan(technique)
                if technique == "fp8":
                    convert_model(whole, FP8, emulate=True, fsdp=False)
                    # As the app's precision plugin converts under FSDP2: torchao all-gathers the FP8 weights over
                    # the data-parallel ranks (apply_rewrites' own conversion then finds the model converted).
                    convert_model(holder, FP8, emulate=True, fsdp=family == "fsdp_tp")
                rewrite = apply_rewrites(holder, plan, tp_mesh=mesh["tp"])
                steps = rewrite.steps
                if family == "fsdp_tp":
                    apply_fully_shard(holder, ["Block"], mesh["dp"], cpu_offload=False, reshard_after_forward=True)
                bf16 = technique in ("keep_fp32", "fp8")
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    want = _loss("gpt", whole, batch)
                    want.backward()
                counter = SavedTensorsCounter()
                with loss_parallel(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), _float8_mms() as mms:
                    with counter:
                        loss = _loss("gpt", holder, batch)
                    loss.backward()
                    with torch.no_grad():  # as validation runs it after training steps
                        no_grad = float(_whole(_loss("gpt", holder, batch)))
                value = float(_whole(loss))
                grads = all(p.grad is not None for p in holder.parameters())
                error = gradient_relative_error(
                    [p.grad for p in whole.parameters()], [_whole(p.grad) for p in holder.model.parameters()]
                )
                got[cell] = {"loss": value, "want": float(want), "steps": steps, "grads": grads, "grad_error": error}
                got[cell]["no_grad_loss"] = no_grad
                conversion = rewrite.conversion
                got[cell]["fsdp_float8_all_gather"] = conversion is not None and conversion.fsdp_float8_all_gather
                got[cell]["float8_layers"] = sum(type(m).__name__ == "Float8Linear" for m in holder.modules())
                got[cell]["float8_mm_weights"] = sorted(set(mms))
                got[cell]["saved_by_dtype"] = counter.report().by_dtype
                if isinstance(plan.saved_tensors, Int8Compressor):
                    got[cell]["n_compressed"] = plan.saved_tensors.n_compressed
            except Exception as err:  # recorded per cell, so one failure names its cell
                got[cell] = {"error": f"{type(err).__name__}: {err}"}
    for kind in ("gpt", "hf"):
        got[f"no_sequence_parallel_{kind}"] = _no_sequence_parallel(kind, mesh["tp"], batch)
    got["fp8_sequence_parallel"] = _refusal(
        lambda: apply_rewrites(
            Holder(GPT(SHAPE)), replace(_technique_plan("fp8"), sequence_parallel=True), tp_mesh=mesh["tp"]
        )
    )
    return got


def _no_sequence_parallel(kind: str, tp_mesh: Any, batch: torch.Tensor) -> dict[str, Any]:
    """TP without sequence parallelism (fp32; Hugging Face's Llama with tied embeddings) against the whole model."""
    torch.manual_seed(0)
    whole = GPT(SHAPE) if kind == "gpt" else _hf_llama(tied=True)
    model = copy.deepcopy(whole)
    report = apply_tensor_parallel(model, tp_mesh, sequence_parallel=False)
    want = _loss(kind, whole, batch)
    want.backward()
    with loss_parallel():
        loss = _loss(kind, model, batch)
        loss.backward()
    error = gradient_relative_error([p.grad for p in whole.parameters()], [_whole(p.grad) for p in model.parameters()])
    norms = [n for n, p in model.named_parameters() if p.dim() == 1]
    return {
        "loss": float(_whole(loss)),
        "want": float(want),
        "grad_error": error,
        "sequence_parallel": report.sequence_parallel,
        "norms_plain": all(not isinstance(p, DTensor) for n, p in model.named_parameters() if n in norms),
    }


def _refusal(run: Any) -> str:
    try:
        run()
    except IncompatibleConfigError as err:
        return str(err)
    return "not refused"


def _split(kind: str, model: nn.Module, mesh: Any, dims: ParallelDims) -> Holder:
    """TP over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]`` as the strategy does (blocks, then the model)."""
    apply_tensor_parallel(model, mesh["tp"])
    holder = Holder(model)
    if dims.dp > 1:
        block = "Block" if kind == "gpt" else "LlamaDecoderLayer"
        apply_fully_shard(holder, [block], mesh["dp"], cpu_offload=False, reshard_after_forward=True)
    return holder


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def meta(dims: ParallelDims, rank: int, out: Path) -> dict[str, Any]:
    """Meta builds split by TP x FSDP2 against whole builds, and a pretrained Llama read slice by slice."""
    from transformers import LlamaForCausalLM

    from lightning_trainopt.models.hf import _saved_tensors
    from lightning_trainopt.parallel import meta_init

    mesh = init_device_mesh("cpu", (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    got: dict[str, Any] = {}
    for kind in ("gpt", "hf"):
        build = (lambda: GPT(SHAPE)) if kind == "gpt" else (lambda: _hf_llama(tied=True))
        torch.manual_seed(3)
        whole = build()
        torch.manual_seed(3)
        state = torch.get_rng_state()
        with torch.device("meta"):
            model = build()
        torch.manual_seed(999)  # whatever runs between the build and the replay
        holder = _split(kind, model, mesh, dims)
        n = meta_init.materialize_sharded(holder, torch.device("cpu"), state)
        full = _full(model)
        embed, head = ("embed", "lm_head") if kind == "gpt" else ("model.embed_tokens", "lm_head")
        got[kind] = {
            "n": n,
            "names": len(full),
            "differ": [name for name, p in whole.named_parameters() if not torch.equal(p, full.get(name, p[:0]))],
            "tied": model.get_submodule(head).weight is model.get_submodule(embed).weight,
            "local_share": _elements(model) / sum(p.numel() for p in whole.parameters()),
        }
    # A pretrained Llama: rank 0 saves it, every rank reads only its pieces.
    weights = out / "pretrained"
    if rank == 0:
        torch.manual_seed(11)
        _hf_llama(tied=True).save_pretrained(str(weights))
    dist.barrier()
    reference = LlamaForCausalLM.from_pretrained(str(weights), local_files_only=True)
    with torch.device("meta"):
        model = _hf_llama(tied=True)
    holder = _split("hf", model, mesh, dims)
    read: list[int] = []
    original = meta_init._read_piece

    def counting(*args: Any) -> Any:
        tensor = original(*args)
        read.append(tensor.numel())
        return tensor

    meta_init._read_piece = counting  # type: ignore[assignment]
    try:
        meta_init.materialize_sharded(holder, torch.device("cpu"), None, pretrained=(model, _saved_tensors(weights)))
    finally:
        meta_init._read_piece = original  # type: ignore[assignment]
    full = _full(model)
    probe = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    with torch.no_grad():
        logits = model(probe).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        want = reference(probe).logits
    got["pretrained"] = {
        "differ": [name for name, p in reference.named_parameters() if not torch.equal(p, full.get(name, p[:0]))],
        "names": len(full),
        "logits_max_diff": float((logits - want).abs().max()),
        "read_share": sum(read) / sum(p.numel() for p in reference.parameters()),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }
    return got


def lora(dims: ParallelDims, replicate: int) -> dict[str, Any]:
    """``adapter=lora`` under ``+strategy=fsdp_tp``: LoRA injected (step 1 of the rewrite), the adapter TP plan on the
    TP mesh, then ``fully_shard`` over the data-parallel mesh (``replicate`` > 1: HSDP's 2-D one), as
    ``TrainOptTPStrategy`` does; SGD with momentum on each data-parallel rank's half of the global batch against a
    one-process replay of the same model on the whole batch: the losses, the trained adapters, whether a frozen
    weight changed, the optimizer state's elements against the adapters'."""
    names = ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (replicate, dims.dp // replicate, dims.tp), mesh_dim_names=names)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
    torch.manual_seed(0)
    spec = AdapterSpec(kind="lora", r=4, alpha=8, dropout=0.0)
    whole = Holder(GPT(SHAPE))
    apply_rewrites(whole, RewritePlan(adapter=spec))
    holder = copy.deepcopy(whole)
    apply_rewrites(holder, RewritePlan(tensor_parallel=2), tp_mesh=mesh["tp"])  # the adapters are in the copy
    if dims.dp > 1:
        apply_fully_shard(holder, ["Block"], dp_mesh, cpu_offload=False, reshard_after_forward=True)
    frozen = {n: _whole(p).detach().clone() for n, p in holder.named_parameters() if not p.requires_grad}
    trainable = [p for p in holder.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5, momentum=0.9)
    opt_whole = torch.optim.SGD([p for p in whole.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    losses, whole_losses = [], []
    dp_rank = dims.dp_rank(dist.get_rank())
    for step in range(STEPS):
        batch = torch.randint(0, VOCAB, (2 * dims.dp, SEQ), generator=torch.Generator().manual_seed(step))
        want = _loss("gpt", whole, batch)
        want.backward()
        opt_whole.step()
        opt_whole.zero_grad()
        whole_losses.append(float(want.detach()))
        with loss_parallel():
            part = _whole(_loss("gpt", holder, batch[2 * dp_rank : 2 * dp_rank + 2]))
            part.backward()
        opt.step()
        opt.zero_grad()
        mean = part.detach().clone()
        dist.all_reduce(mean)  # every rank of a tensor-parallel group holds its replica's loss
        losses.append(float(mean) / dims.world_size)
    after = {n: _whole(p).detach() for n, p in holder.named_parameters() if not p.requires_grad}
    # SGD's momentum buffers: a DTensor counts its whole size (FSDP2 and TP shard it as its parameter).
    state = sum(_whole(s["momentum_buffer"]).numel() for s in opt.state.values())
    trained = {n: _whole(p).detach() for n, p in holder.named_parameters() if p.requires_grad}
    want_trained = {n: p.detach() for n, p in whole.named_parameters() if p.requires_grad}
    return {
        "adapter_names_match": trained.keys() == want_trained.keys(),
        "adapter_max_diff": max(float((trained[n] - want_trained[n]).abs().max()) for n in trained),
        "lora_b_norm": sum(float(p.norm()) for n, p in trained.items() if "lora_B" in n),
        "losses": losses,
        "whole_losses": whole_losses,
        "base_unchanged": all(torch.equal(frozen[n], after[n]) for n in frozen),
        "frozen_numel": sum(t.numel() for t in frozen.values()),
        "trainable_numel": sum(_whole(p).numel() for p in trainable),
        "state_numel": state,
        "state_params": len(opt.state),
        "dtensors": sum(isinstance(p, DTensor) for p in trainable),
    }


class Probe(pl.Callback):
    """Records the dims, the loader's sharding, each batch and each loss of this rank."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {"batches": [], "losses": [], "grad_norms": [], "clipped_norms": []}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before configure_model: the strategy builds this module on the meta device.
        self.seen["builds_on_meta"] = trainer.strategy.builds_on_meta(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dims = ParallelDims.from_trainer(trainer)
        sampler = trainer.train_dataloader.sampler
        self.seen.update(
            dims=dims.to_dict(),
            dp=dims.dp,
            sampler={"num_replicas": sampler.num_replicas, "rank": sampler.rank},
            mesh=list(trainer.strategy.device_mesh.mesh_dim_names),
            dtensors=sum(isinstance(p, DTensor) for p in pl_module.parameters()),
            params=sum(1 for _ in pl_module.parameters()),
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.seen["batches"].append(batch[0].tolist())

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any, i: int) -> None:
        self.seen["losses"].append(float(out["loss"]))
        # The gradients Lightning clipped and stepped with (zeroed only before the next step).
        self.seen["clipped_norms"].append(float(clip_grad_norm_(module.parameters(), float("inf"))))

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        # Lightning clips after this hook: the total norm before clipping.
        self.seen["grad_norms"].append(float(clip_grad_norm_(module.parameters(), float("inf"))))


def fit(dims: ParallelDims) -> dict[str, Any]:
    probe = Probe()
    replicate = 2 if dims.world_size == 4 else 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dims.world_size,
        strategy=TrainOptTPStrategy(tensor_parallel_size=2, replicate=replicate),
        max_steps=3,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[probe],
    )
    torch.manual_seed(0)
    trainer.fit(LitGPT(SHAPE), tiny_data(batch_size=2, seq_len=SEQ))
    return probe.seen


def distill(out: Path) -> dict[str, Any]:
    """``experiment=distill`` under ``+strategy=fsdp_tp`` (TP 2 x FSDP2 2): a Lightning fit of a GPT student with a
    GPT teacher (tests/integration/_distill_worker.py's shapes), then the teacher's placement (TP's plan, then FSDP2's
    shards: a quarter of it per rank), whether it is frozen, outside the optimizer and bit-identical to its
    checkpoint, and the sharded module's loss of one batch against the one-process loss of the same weights."""
    from dataclasses import asdict

    from lightning_trainopt.checkpoint.teacher import teacher_source
    from lightning_trainopt.models.distill import DistillGPT, DistillSpec
    from tests.integration._distill_worker import TOKENS, _data, _reference_loss

    path = out / "teacher.ckpt"
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        shape = GPTConfig(n_layers=2, d_model=48, n_heads=2, ffn_hidden=96, max_seq_len=16)
        state = {f"model.{k}": v for k, v in GPT(shape).state_dict().items()}
        torch.save({"state_dict": state, "hyper_parameters": {"model": asdict(shape)}}, path)
    dist.barrier()
    source = teacher_source(str(path))
    student = GPTConfig(n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=16)
    spec = DistillSpec(source.path, alpha=0.5, temperature=2.0, chunk_tokens=5)
    module = DistillGPT(student, source, spec)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=TrainOptTPStrategy(tensor_parallel_size=2), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(module, train_dataloaders=_data())
    teacher = module.teacher
    assert teacher is not None
    saved = source.load_state()
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    with torch.no_grad():
        loss, _ = module.batch_loss((TOKENS[:2, :-1], TOKENS[:2, 1:]))
        width = module.head_loss.last.logits_width
        student_state = {n: _whole(p).detach() for n, p in module.model.named_parameters()}
    head = teacher.lm_head.weight
    return {
        "teacher_head_mesh": list(head.device_mesh.mesh_dim_names or ()),
        "teacher_head_placements": [str(p) for p in head.placements],
        "teacher_local_fraction": sum(p.to_local().numel() for p in teacher.parameters())
        / sum(p.numel() for p in teacher.parameters()),
        "teacher_bit_identical": all(torch.equal(_whole(p), saved[n]) for n, p in teacher.named_parameters()),
        "teacher_frozen": all(not p.requires_grad and p.grad is None for p in teacher.parameters()),
        "teacher_eval": not teacher.training,
        "teacher_in_optimizer": any(id(p) in optimized for p in teacher.parameters()),
        "sharded_loss": float(loss),
        "reference_loss": _reference_loss(source, student_state),
        "logits_width": width,
        "vocab": head.shape[0],
        "train_kl": float(trainer.callback_metrics["train/kl"]),
    }


def fp8_nccl(rank: int) -> dict[str, Any]:
    """FP8 with sequence parallelism on GPUs (NCCL all-gathers float8): TP 2 against the same FP8 model on one GPU,
    real FP8 GEMMs, sizes torch._scaled_mm takes (multiples of 16 on each rank's shard)."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    shape = GPTConfig(
        name="tp-fp8", vocab_size=VOCAB, n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=SEQ
    )
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("tp",))
    batch = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7)).to(device)
    torch.manual_seed(0)
    whole = GPT(shape).to(device)
    holder = Holder(copy.deepcopy(whole))
    convert_model(whole, FP8, emulate=False, fsdp=False)
    plan = RewritePlan(precision=FP8, emulate_fp8=False, tensor_parallel=2, sequence_parallel=True)
    report = apply_rewrites(holder, plan, tp_mesh=mesh["tp"])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = _loss("gpt", whole, batch)
        want.backward()
    with loss_parallel(), torch.autocast("cuda", dtype=torch.bfloat16), _float8_mms() as mms:
        loss = _loss("gpt", holder, batch)
        loss.backward()
    error = gradient_relative_error(
        [p.grad for p in whole.parameters()], [_whole(p.grad) for p in holder.model.parameters()]
    )
    assert report.tensor_parallel is not None
    return {
        "loss": float(_whole(loss)),
        "want": float(want),
        "grad_error": error,
        "sequence_parallel": report.tensor_parallel.sequence_parallel,
        "float8_mms": len(mms),
    }


def main(out: Path) -> None:
    if len(sys.argv) > 2 and sys.argv[2] == "nccl":
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        (out / f"rank{rank}.json").write_text(json.dumps({"fp8_nccl": fp8_nccl(rank)}))
        dist.destroy_process_group()
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.from_world(world, tp=2)
    seen: dict[str, Any] = {"rank": rank, "raw": {kind: raw(kind, dims, rank) for kind in ("gpt", "hf")}}
    seen["walk"] = walk(dims)
    seen["hf_split"] = hf_split(dims)
    if world == 4:
        seen["meta"] = meta(dims, rank, out)
        seen["lora"] = {"fsdp": lora(dims, replicate=1), "hsdp": lora(dims, replicate=2)}
    seen["chunked"] = chunked(dims)
    seen["chunked_hf"] = chunked(dims, "hf")
    seen["fit"] = fit(dims)
    if world == 4:
        seen["distill"] = distill(out)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
