"""One 2-rank gloo worker for ``test_meta_build.py``: FSDP2 meta builds of a Hugging Face model (from its config and
from ``model.pretrained``) and of a user's module, each checked against a whole build on the same rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_trainopt.models import HFModelConfig, LitCausalLM
from lightning_trainopt.parallel import TrainOptFSDPStrategy, meta_init

SEED = 1234
STEPS = 2
VOCAB = 67  # odd: the embedding's rows do not split evenly over 2 ranks


class RecordingLM(LitCausalLM):
    """Notes whether ``configure_model`` built the Hugging Face model on the meta device."""

    built_on_meta: bool | None = None

    def configure_model(self) -> None:
        fresh = self.model is None
        super().configure_model()
        if fresh:
            assert self.model is not None
            self.built_on_meta = all(p.is_meta for p in self.model.parameters())


class UserModule(pl.LightningModule):
    """A user's module whose ``configure_model`` builds its layers (every one has ``reset_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net: torch.nn.Module | None = None
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = torch.nn.Sequential(
                torch.nn.Embedding(VOCAB, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, VOCAB)
            )
            self.built_on_meta = all(p.is_meta for p in self.net.parameters())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.net is not None
        return torch.nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(pl.Callback):
    """Whole copies of the weights at fit start, the logits of a fixed input, and each step's loss."""

    def __init__(self, probe: torch.Tensor | None) -> None:
        self.probe = probe
        self.weights: dict[str, torch.Tensor] = {}
        self.logits: torch.Tensor | None = None
        self.local_numel = 0
        self.losses: list[float] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, p in pl_module.named_parameters():
            full = getattr(p, "full_tensor", None)
            self.weights[name] = (full() if callable(full) else p).detach().clone()
            local = getattr(p, "to_local", None)
            self.local_numel += (local() if callable(local) else p).numel()
        if self.probe is not None:
            with torch.no_grad():
                self.logits = pl_module.model(input_ids=self.probe).logits.detach().clone()  # type: ignore[union-attr]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(module: pl.LightningModule, meta_init: bool, probe: torch.Tensor | None) -> Record:
    torch.manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (8, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    record = Record(probe)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TrainOptFSDPStrategy(meta_init=meta_init),
        max_steps=STEPS,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    return record


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or are missing on one side)."""
    names = a.keys() | b.keys()
    return sorted(name for name in names if name not in a or name not in b or not torch.equal(a[name], b[name]))


def worker(rank: int, port: int, workdir: str, results: dict) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    # A test that ran seed_everything earlier in the same pytest worker leaves PL_GLOBAL_SEED in the environment the
    # ranks inherit; Lightning's strategies then re-seed from it while setting up (reset_seed), before
    # configure_model, and the user module's build below would draw from another seed than its eager reference.
    os.environ.pop("PL_GLOBAL_SEED", None)
    config_dir, weights_dir = Path(workdir, "config"), Path(workdir, "weights")
    out: dict[str, Any] = {}

    # 1. model=hf from its config (tied embeddings): the meta build against the whole build, weights and steps.
    spec = HFModelConfig(config=str(config_dir), attn_implementation="eager")
    meta_lm = RecordingLM(spec)
    meta = _fit(meta_lm, True, None)
    whole_lm = RecordingLM(spec)
    whole = _fit(whole_lm, False, None)
    hf = meta_lm.model
    assert hf is not None
    out["hf"] = {
        "built_on_meta": (meta_lm.built_on_meta, whole_lm.built_on_meta),
        "differ": _equal(meta.weights, whole.weights),
        "n_weights": len(whole.weights),
        "tied": hf.lm_head.weight is hf.model.embed_tokens.weight,
        "losses": (meta.losses, whole.losses),
        "local_share": meta.local_numel / sum(t.numel() for t in meta.weights.values()),
        "inv_freq": torch.equal(hf.model.rotary_emb.inv_freq, whole_lm.model.model.rotary_emb.inv_freq),  # type: ignore[union-attr]
    }

    # 2. model.pretrained: each rank reads its slices of the safetensors files; against from_pretrained.
    probe = torch.arange(12).reshape(2, 6) % VOCAB
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(weights_dir), attn_implementation="eager", local_files_only=True
    )
    with torch.no_grad():
        ref_logits = reference(input_ids=probe).logits
    read: list[int] = []
    original = meta_init._read_piece

    def counting(*args: Any) -> Any:
        tensor = original(*args)
        read.append(tensor.numel())
        return tensor

    meta_init._read_piece = counting  # type: ignore[assignment]
    try:
        loaded_lm = RecordingLM(HFModelConfig(pretrained=str(weights_dir), attn_implementation="eager"))
        loaded = _fit(loaded_lm, True, probe)
    finally:
        meta_init._read_piece = original  # type: ignore[assignment]
    ref_weights = {f"model.{name}": p.detach() for name, p in reference.named_parameters()}
    assert loaded.logits is not None
    out["pretrained"] = {
        "built_on_meta": loaded_lm.built_on_meta,
        "differ": _equal(loaded.weights, ref_weights),
        "logits_max_diff": float((loaded.logits - ref_logits).abs().max()),
        "read_share": sum(read) / sum(p.numel() for p in reference.parameters()),
        "files": len({p.name for p in weights_dir.glob("*.safetensors")}),
    }

    # 3. a user's module that builds its layers in configure_model: reset_parameters per shard.
    # Against an eager build from the seed the fit starts from (nothing in Lightning draws before configure_model).
    user_module = UserModule()
    user_meta = _fit(user_module, True, None)
    torch.manual_seed(SEED)
    eager = UserModule()
    eager.configure_model()
    out["user"] = {
        "built_on_meta": user_module.built_on_meta,
        "differ": _equal(user_meta.weights, {name: p.detach() for name, p in eager.named_parameters()}),
        "n_weights": len(user_meta.weights),
        "losses": user_meta.losses,
    }
    out["gpt"] = _gpt_preset()
    results[rank] = out


def _gpt_preset() -> dict[str, Any]:
    """Our GPT, sharded by hand with ``fully_shard`` on the process group the fits left, against a whole build."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_trainopt.models import GPT
    from lightning_trainopt.models.config import GPTConfig

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    # Odd sizes: the vocabulary (67 rows) does not split evenly over 2 ranks, so FSDP2 pads rank 1's shard.
    shape = GPTConfig(name="meta", vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=2, ffn_hidden=48, max_seq_len=16)
    torch.manual_seed(SEED)
    eager = GPT(shape)
    after_eager = torch.get_rng_state()
    torch.manual_seed(SEED)
    state = torch.get_rng_state()
    with torch.device("meta"):
        model = GPT(shape)
    torch.manual_seed(999)  # whatever ran between the build and the replay
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    n = meta_init.materialize_sharded(model, torch.device("cpu"), state)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {
        "n": n,
        "equal": [name for name, p in eager.named_parameters() if torch.equal(p, full[name])],
        "names": [name for name, _ in eager.named_parameters()],
        "rng_as_after_eager": torch.equal(torch.get_rng_state(), after_eager),
        "local_rows": model.embed.weight.to_local().shape[0],
        "tied": model.lm_head.weight is model.embed.weight,
    }
