"""Multi-process worker for tests/integration/test_adapter_sharding.py (run as a script, 2 CPU processes, gloo).

Usage: python tests/integration/_adapter_sharding_worker.py OUT_JSON CASE [CASE ...]
  CASE: STRATEGY:ADAPTER[:resume][:TRANSFORMS], e.g. ``zero3:lora:resume`` or ``fsdp:qlora:ckpt+bf16``;
  STRATEGY: ddp | zero2 | zero3 | fsdp | tp; ADAPTER: lora | qlora; TRANSFORMS: ``+``-joined names of
  :data:`TRANSFORMS` (``ckpt``: activations=checkpoint, ``int8``: activations=int8, ``chunked_ce``: loss=chunked_ce,
  ``bf16``: precision=bf16), built from the app's config files and installed as train.py installs them.
Each case fits a tiny GPT with the adapter for 4 steps (with ``resume``: 2 steps, a checkpoint, and a second fit that
resumes it for 2 more); all cases run one after another in one pair of processes. The optimizer is SGD with momentum:
its update is linear in the gradient, so the fits' losses can be compared closely with a one-process replay (Adam's
first steps amplify rounding). Rank 0 replays the same global batches on one process (the same seed's model and adapter,
from the fit's starting weights) and writes, per case: the fits' losses and the replay's, whether any frozen parameter
changed, the optimizer-state and trainable element counts, whether the resumed fit started from the saved adapters and
step, and the adapters' ``lora_B`` norm at the start (peft initialises it to zero). A case that raises ends the launch;
the cases before it are written.

With transforms, each case also records what shows they ran in the fit: the rewrite's checkpointed blocks and how often
each block's forward ran per step (twice: forward and recompute), int8's compressed storages per step, whether the
output head returned the chunked loss instead of logits, and the dtype of the adapters' matmul output and of the
adapter parameters the strategy trains; the replay applies the same transforms (bf16: CPU autocast, as Lightning's
mixed-precision plugin).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightning_trainopt.config.rewrite import install_app_rewrites  # noqa: E402
from lightning_trainopt.config.strategy import build_strategy  # noqa: E402
from lightning_trainopt.data.datamodule import TextDataModule  # noqa: E402
from lightning_trainopt.launch.multirun import teardown_distributed  # noqa: E402
from lightning_trainopt.models.config import GPTConfig  # noqa: E402
from lightning_trainopt.models.lit_gpt import LitGPT  # noqa: E402
from lightning_trainopt.parallel.apply import rewrite_report  # noqa: E402
from lightning_trainopt.parallel.spec import precision_needs  # noqa: E402
from lightning_trainopt.precision import trainer_precision_kwargs  # noqa: E402
from lightning_trainopt.transforms.adapters import AdapterSpec  # noqa: E402

CFG = GPTConfig(name="worker", vocab_size=64, n_layers=2, d_model=64, n_heads=2, ffn_hidden=128, max_seq_len=32)
MICRO = 2
LR = 0.5
CONF = os.path.join(os.path.dirname(__file__), "..", "..", "lightning_trainopt", "conf")
#: A case's transform -> the app's config file that turns it on (``GROUP/NAME.yaml``).
TRANSFORMS = {
    "ckpt": "activations/checkpoint",
    "int8": "activations/int8",
    "chunked_ce": "loss/chunked_ce",
    "bf16": "precision/bf16",
}
#: loss=chunked_ce's tokens per chunk: a rank's 64 tokens in 4 chunks (the preset's 1024 would be one chunk here).
CHUNK_TOKENS = 16


#: The token ids each saved fit's adapter model scores after the save (``RUN_DIR/adapter_logits.pt``), for the export.
PROBE = torch.arange(2 * 32).reshape(2, 32) % 64


class AdapterGPT(LitGPT):
    """LitGPT with the adapter applied as train.py applies it (``install_app_rewrites``): step 1 of the ordered
    rewrite, at ``configure_model`` (under FSDP2/TP the strategy then builds the model whole, not on the meta device),
    and checkpoints that record the adapter and leave out the frozen base where they can."""

    def __init__(self, adapter: str, transforms: tuple[str, ...] = ()) -> None:
        loss = None
        if "chunked_ce" in transforms:
            loss = instantiate(_node("chunked_ce"), chunk_tokens=CHUNK_TOKENS, _convert_="all")
        super().__init__(CFG, optimizer=partial(torch.optim.SGD, lr=LR, momentum=0.9), loss=loss)
        spec = AdapterSpec(kind=adapter, r=4, alpha=8, dropout=0.0)  # type: ignore[arg-type]
        # The activations= group's callbacks, as build_run instantiates them; the rewrite makes them report-only.
        self.activations = [
            instantiate(node, _convert_="all")
            for name in ("ckpt", "int8")
            if name in transforms
            for node in _node(name).values()
        ]
        install_app_rewrites(self, self.activations, adapter=spec)

    def int8_compressed(self) -> int:
        """Storages the int8 transform compressed so far (0 without it)."""
        return sum(getattr(getattr(cb, "transform", None), "n_compressed", 0) for cb in self.activations)


def _node(transform: str) -> Any:
    """The app's config node of a transform (``conf/GROUP/NAME.yaml``)."""
    return OmegaConf.load(os.path.join(CONF, TRANSFORMS[transform] + ".yaml"))


def _precision(transforms: tuple[str, ...]) -> Any:
    """The precision preset the case's ``precision=`` would select, as the app builds it."""
    return instantiate(
        OmegaConf.load(os.path.join(CONF, "precision", "bf16.yaml" if "bf16" in transforms else "fp32.yaml"))
    )


def gathered(module: torch.nn.Module, zero3: bool, trainable: bool) -> dict[str, torch.Tensor]:
    """The trainable (or frozen) parameters whole, on every rank (collective)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad == trainable]
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in named}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # bytes, not values: a 4-bit weight stored as bf16 holds bit patterns that read as NaN
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a
    )


#: The adapter whose forward calls and output dtype show recompute and the compute dtype (a child of a checkpointed
#: block: its forward runs again in the recompute, which calls the block's original forward, not the block).
PROBE_LAYER = "model.blocks.0.attn.q_proj.lora_A.default"


class Record(pl.Callback):
    def __init__(self, zero3: bool) -> None:
        self.zero3 = zero3
        self.hooks: list[Any] = []
        self.layer_calls = 0
        self.compute_dtypes: set[str] = set()
        self.head_outputs: list[int] = []  # the head's output's number of dimensions per training forward
        self.int8_before = 0
        self.int8_per_step: list[int] = []
        self.frozen_with_grad = 0
        self.trainable_dtypes: set[str] = set()
        self.trainable_names_are_adapters = False
        self.checkpointed: list[str] = []
        self.losses: list[float] = []
        self.batches: list[list[torch.Tensor]] = []
        self.start_step = -1
        self.frozen_before: dict[str, torch.Tensor] = {}
        self.frozen_changed: bool | None = None
        self.adapters_start: dict[str, torch.Tensor] = {}
        self.adapters_end: dict[str, torch.Tensor] = {}
        self.state_numel = 0
        self.trainable_numel = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step
        self.frozen_before = gathered(pl_module, self.zero3, trainable=False)
        self.adapters_start = gathered(pl_module, self.zero3, trainable=True)
        self.trainable_names_are_adapters = bool(self.adapters_start) and all(
            ".lora_A." in n or ".lora_B." in n for n in self.adapters_start
        )
        self.trainable_dtypes = {str(p.dtype) for p in pl_module.parameters() if p.requires_grad}
        report = rewrite_report(pl_module)
        self.checkpointed = list(report.checkpoint.wrapped) if report is not None and report.checkpoint else []
        modules = dict(pl_module.named_modules())

        def layer(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            if mod.training:
                self.layer_calls += 1
                self.compute_dtypes.add(str(out.dtype))

        def head(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            if mod.training:
                self.head_outputs.append(out.ndim)

        self.hooks = [
            modules[PROBE_LAYER].register_forward_hook(layer),
            modules["model.lm_head"].register_forward_hook(head),
        ]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.batches.append([t.detach().clone() for t in batch])
        self.int8_before = pl_module.int8_compressed()  # type: ignore[operator]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        self.int8_per_step.append(pl_module.int8_compressed() - self.int8_before)  # type: ignore[operator]

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.frozen_with_grad += sum(p.grad is not None for p in pl_module.parameters() if not p.requires_grad)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self.losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self.hooks:
            hook.remove()
        self.frozen_changed = not _same(self.frozen_before, gathered(pl_module, self.zero3, trainable=False))
        self.adapters_end = gathered(pl_module, self.zero3, trainable=True)
        self.trainable_numel = sum(p.numel() for p in self.adapters_end.values())
        # SGD's momentum buffers: a DTensor counts its whole size; a ZeRO partition its own piece (summed over ranks).
        optimizer = trainer.optimizers[0]
        states = getattr(optimizer, "optimizer", optimizer).state.values()
        local = sum(s["momentum_buffer"].numel() for s in states if s.get("momentum_buffer") is not None)
        total = torch.tensor(float(local))
        if self.zero3 or isinstance(trainer.strategy, pl.strategies.DeepSpeedStrategy):
            torch.distributed.all_reduce(total)
        self.state_numel = int(total)


def _strategy(name: str, precision: Any) -> Any:
    """The ``+strategy=NAME`` preset built as train.py builds it (``build_strategy``: DeepSpeed's bf16 from the
    precision preset, its bucket sizes from the micro-batch)."""
    node = OmegaConf.load(os.path.join(CONF, "strategy", f"{name}.yaml"))
    return build_strategy(node, precision, {"accelerator": "cpu", "devices": 2}, micro_batch_size=MICRO)


def _fit(
    strategy: str, adapter: str, transforms: tuple[str, ...], max_steps: int, ckpt: str | None, save: str | None
) -> Record:
    pl.seed_everything(7, workers=True)
    record = Record(zero3=strategy == "zero3")
    data = TextDataModule(
        corpus="synthetic", seq_len=32, batch_size=MICRO, synthetic_tokens=8192, vocab_size=64, seed=7
    )
    precision = _precision(transforms)
    built = _strategy(strategy, precision)
    module = AdapterGPT(adapter, transforms)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=built,
        **trainer_precision_kwargs(precision, precision_needs(built), "cpu"),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[record, *module.activations],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
        # The saved adapter model's logits (a collective forward: the sharded weights are gathered), which
        # tests/integration/test_adapter_sharding.py compares with trainopt-export's outputs.
        module.eval()
        with torch.no_grad():
            logits = module.model(PROBE)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        if torch.distributed.get_rank() == 0:
            torch.save(logits.float(), os.path.join(os.path.dirname(os.path.dirname(save)), "adapter_logits.pt"))
    if strategy != "tp":  # each data-parallel rank's loss is its micro-batch's mean: average them
        losses = torch.tensor(record.losses)
        torch.distributed.all_reduce(losses)
        record.losses = (losses / torch.distributed.get_world_size()).tolist()
    all_batches: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(all_batches, record.batches)
    # each step's global batch: the ranks' micro-batches side by side (TP ranks share one)
    ranks = all_batches[:1] if strategy == "tp" else all_batches
    record.batches = [[torch.cat(parts) for parts in zip(*step)] for step in zip(*ranks)]
    return record


def _replay(
    adapter: str,
    transforms: tuple[str, ...],
    batches: list[list[torch.Tensor]],
    adapters: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    load_frozen: bool,
) -> tuple[list[float], bool]:
    """The same seed's model and adapter on one process, from the fit's starting weights (the adapters, and the
    frozen base unless it is 4-bit), trained on the global batches the fits saw: its loss per step, then the first
    batch's loss after the steps; and whether its frozen weights are the fit's (a 4-bit base is quantized by each
    build from the same seed's weights). The case's transforms apply here too: the rewrite's at ``configure_model``,
    bf16 as Lightning's ``bf16-mixed`` plugin runs the training step (CPU autocast; backward outside it)."""
    pl.seed_everything(7, workers=True)
    module = AdapterGPT(adapter, transforms)
    module.configure_model()
    if load_frozen:
        module.load_state_dict(frozen, strict=False)
    module.load_state_dict(adapters, strict=False)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses = []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in transforms)
    for batch in batches:
        with autocast:
            loss, _ = module.batch_loss(batch)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad(), autocast:  # the first batch again, after the steps: the adapters learned
        losses.append(float(module.batch_loss(batches[0])[0]))
    # in the fit's dtype: DeepSpeed's bf16 holds the frozen base in bf16 (loaded above into fp32: exact)
    same = _same(
        frozen, {n: p.detach().to(frozen[n].dtype) for n, p in module.named_parameters() if not p.requires_grad}
    )
    return losses, same


def _next_process_group() -> None:
    """A fresh process group on a fresh port for the next fit (as the memory-techniques worker does)."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    port = [find_free_network_port() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    teardown_distributed()


def parse_case(case: str) -> tuple[str, str, bool, tuple[str, ...]]:
    """``STRATEGY:ADAPTER[:resume][:TRANSFORMS]`` -> strategy, adapter, resume, transforms."""
    strategy, adapter, *rest = case.split(":")
    resume = "resume" in rest
    named = [part for part in rest if part != "resume"]
    transforms = tuple(named[0].split("+")) if named else ()
    unknown = [t for t in transforms if t not in TRANSFORMS]
    if len(named) > 1 or unknown:
        raise ValueError(f"case {case!r}: transforms are one '+'-joined field of {sorted(TRANSFORMS)}")
    return strategy, adapter, resume, transforms


def run_case(case: str, folder: str) -> dict[str, Any]:
    strategy, adapter, resume, transforms = parse_case(case)
    if resume:
        # A run folder as train.py lays it out (RUN_DIR/checkpoints/), which trainopt-export takes.
        ckpt = os.path.join(folder, case.replace(":", "_").replace("+", "-"), "checkpoints", "last.ckpt")
        first = _fit(strategy, adapter, transforms, 2, None, ckpt)
        _next_process_group()
        second = _fit(strategy, adapter, transforms, 4, ckpt, None)
    else:
        first = second = _fit(strategy, adapter, transforms, 4, None, None)
    resumed_from_saved = _same(first.adapters_end, second.adapters_start)
    replay, same_base = (
        _replay(
            adapter,
            transforms,
            first.batches + second.batches if resume else first.batches,
            first.adapters_start,
            first.frozen_before,
            adapter == "lora",
        )
        if torch.distributed.get_rank() == 0
        else ([], False)
    )
    b_norm = sum(float(p.float().norm()) for n, p in first.adapters_start.items() if "lora_B" in n)
    fits = (first, second) if resume else (first,)
    _next_process_group()
    return {
        "losses": first.losses + second.losses if resume else first.losses,
        "replay": replay,
        "replay_same_base": same_base,
        "frozen_changed": [first.frozen_changed, second.frozen_changed],
        "state_numel": first.state_numel,
        "trainable_numel": first.trainable_numel,
        "frozen_numel": sum(p.numel() for p in first.frozen_before.values()),
        "resumed_step": second.start_step,
        "resumed_from_saved": resumed_from_saved,
        "lora_b_norm_at_start": b_norm,
        "run_dir": os.path.dirname(os.path.dirname(ckpt)) if resume else None,
        # what shows the transforms ran (rank 0's view; the ranks run the same code)
        "steps": sum(len(f.int8_per_step) for f in fits),
        "checkpointed": first.checkpointed,
        "probe_layer_calls": sum(f.layer_calls for f in fits),
        "compute_dtypes": sorted(set().union(*(f.compute_dtypes for f in fits))),
        "trainable_dtypes": sorted(first.trainable_dtypes),
        "head_output_ndims": sorted(set().union(*(f.head_outputs for f in fits))),
        "int8_per_step": [n for f in fits for n in f.int8_per_step],
        "frozen_with_grad": sum(f.frozen_with_grad for f in fits),
        "trainable_names_are_adapters": all(f.trainable_names_are_adapters for f in fits),
    }


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    results: dict[str, Any] = {}
    folder = os.environ.setdefault("ADAPTER_WORKER_DIR", tempfile.mkdtemp())
    try:
        for case in cases:
            results[case] = run_case(case, folder)
    finally:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            with open(out, "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    main()
