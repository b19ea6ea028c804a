"""Checkpoints of an adapter run: the adapters (and the optimizer, RNG and data position Lightning keeps), without the
frozen base when the run can rebuild it.

The frozen base of a LoRA/QLoRA run is what the model's config (``model=...``, ``model.pretrained``) and the seed
build; writing it into every checkpoint would make each one as large as the model for no state that changes. So
:func:`install_adapter_checkpointing` wraps the LightningModule's ``on_save_checkpoint`` to drop the base's tensors
from ``checkpoint["state_dict"]`` and record how to rebuild it and a SHA-256 of its tensors
(:func:`~lightning_trainopt.transforms.adapters.base_state_hash`); on resume ``on_load_checkpoint`` (which Lightning
calls after ``configure_model`` has rebuilt the model, before it loads the state dict) checks that the rebuilt base
has that hash and that the checkpoint holds every adapter tensor, then lets Lightning load the adapters
(``strict_loading=False``, because the base keys are absent on purpose; the check above replaces strictness).
Lightning's checkpoint has no RNG state; LoRA's dropout draws from torch's generator, so the record carries it and
:func:`restore_rng` sets it at the resumed run's first training batch.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.adapters import (
    AdapterSpec,
    adapter_state_dict,
    base_state_hash,
    describe,
    frozen_base_names,
)

__all__ = ["ADAPTER_KEY", "install_adapter_checkpointing", "restore_frozen_base", "restore_rng", "strip_frozen_base"]

#: The checkpoint entry that records the adapter and how to rebuild its base.
ADAPTER_KEY = "trainopt_adapter"
_HASH = "_trainopt_base_sha256"
_INSTALLED = "_trainopt_adapter_checkpointing"
_PENDING_RNG = "_trainopt_pending_rng"


def strip_frozen_base(module: Any, checkpoint: dict[str, Any], spec: AdapterSpec) -> None:
    """Drop the frozen base from ``checkpoint["state_dict"]`` and record the adapter, the base's hash and how to
    rebuild it under :data:`ADAPTER_KEY`."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        return
    base = frozen_base_names(module)
    # FSDP2/TP checkpoints are sharded (each rank writes its shards) and Lightning's loader asks the files for every
    # key of the sharded model: the base stays there, an N-th of it per rank.
    if any(hasattr(value, "to_local") for value in state.values()):
        base = []
    for key in base:
        state.pop(key, None)
    hparams = dict(getattr(module, "hparams", {}) or {})
    model = hparams.get("model")
    checkpoint[ADAPTER_KEY] = {
        "spec": describe(spec),
        "base_sha256": _base_hash(module),
        "base_tensors_left_out": len(base),
        "adapter_tensors": sorted(adapter_state_dict(module)),
        # How this run builds its base again: the module class with the model node of hyper_parameters (our presets'
        # shape, or model.config / model.pretrained of a Hugging Face model), seeded as the run was.
        "rebuild": {
            "module": f"{type(module).__module__}.{type(module).__qualname__}",
            "model": model if isinstance(model, dict) else None,
            "seed": os.environ.get("PL_GLOBAL_SEED"),
        },
        # LoRA's dropout draws from torch's generator: the resumed run continues its stream (see restore_rng).
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
    }


def restore_frozen_base(module: Any, checkpoint: dict[str, Any]) -> None:
    """Check a checkpoint written by :func:`strip_frozen_base` against the rebuilt ``module``.

    Raises:
        ConfigError: the rebuilt base differs from the one the adapters were trained on (another model, seed or
            ``model.pretrained``), or the checkpoint lacks adapter tensors (key ``ckpt_path``).
    """
    record = checkpoint.get(ADAPTER_KEY)
    if not isinstance(record, dict):
        return
    rebuilt = _base_hash(module)
    if rebuilt != record.get("base_sha256"):
        rebuild = record.get("rebuild", {})
        pretrained = (rebuild.get("model") or {}).get("pretrained")
        if pretrained:
            # The config matched (train.py checks it before building): the files under the directory changed.
            raise ConfigError(
                "model.pretrained",
                pretrained,
                "its weights are not the frozen base this checkpoint's adapters were trained on (SHA-256 of the "
                f"base {str(record.get('base_sha256'))[:12]}..., rebuilt {rebuilt[:12]}...: the files there were "
                "replaced or retrained since); put the original weights back there, or start a new run "
                "(ckpt_path=null).",
            )
        raise ConfigError(
            "ckpt_path",
            "(this checkpoint)",
            "its adapters were trained on another frozen base than this run builds (SHA-256 of the base "
            f"{str(record.get('base_sha256'))[:12]}..., rebuilt {rebuilt[:12]}...); resume with the model, "
            f"model.pretrained and seed of the run that wrote it (seed {rebuild.get('seed')}, model "
            f"{rebuild.get('model')}).",
        )
    state = checkpoint.get("state_dict")
    if state is None:  # a sharded checkpoint (FSDP2/TP, DeepSpeed): the strategy loads the model from its files
        return
    missing = sorted(set(adapter_state_dict(module)) - set(state))
    if missing:
        raise ConfigError(
            "ckpt_path",
            "(this checkpoint)",
            f"it lacks {len(missing)} adapter tensors of this model (first: {missing[0]}); resume with the adapter "
            f"settings it was written with: {record.get('spec')}.",
        )


def restore_rng(module: Any) -> None:
    """Set torch's generators to the state a resumed checkpoint recorded, once, at the first training batch.

    Not in ``on_load_checkpoint``: between it and the first batch the resumed run creates its data loader iterators
    (each draws a seed from torch's generator), draws the uninterrupted run made before the checkpoint. Every rank
    gets rank 0's state: the ranks share the seed, so their streams are the same.
    """
    pending = module.__dict__.pop(_PENDING_RNG, None)
    if not isinstance(pending, dict):
        return
    torch.set_rng_state(pending["torch"])
    cuda = pending.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def install_adapter_checkpointing(module: Any, spec: AdapterSpec) -> None:
    """Make ``module``'s checkpoints hold the adapters without the frozen base, and check the base on resume.

    Wraps ``on_save_checkpoint``/``on_load_checkpoint`` on the instance (a user's LightningModule keeps its own hooks,
    which run first) and sets ``strict_loading=False``. Once per module.
    """
    if not spec.enabled or module.__dict__.get(_INSTALLED):
        return
    module.__dict__[_INSTALLED] = True
    own_save, own_load = module.on_save_checkpoint, module.on_load_checkpoint
    own_batch_start = module.on_train_batch_start

    def on_save_checkpoint(checkpoint: dict[str, Any]) -> None:
        own_save(checkpoint)
        strip_frozen_base(module, checkpoint, spec)

    def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
        own_load(checkpoint)
        restore_frozen_base(module, checkpoint)
        rng = checkpoint.get(ADAPTER_KEY, {}).get("rng")
        if isinstance(rng, dict):
            module.__dict__[_PENDING_RNG] = rng

    def on_train_batch_start(batch: Any, batch_idx: int) -> Any:
        restore_rng(module)
        return own_batch_start(batch, batch_idx)

    module.on_save_checkpoint = on_save_checkpoint
    module.on_load_checkpoint = on_load_checkpoint
    module.on_train_batch_start = on_train_batch_start
    module.strict_loading = False


def _base_hash(module: Any) -> str:
    """The base's hash, worked out once per module: the base is frozen, so it cannot change during the run."""
    cached = module.__dict__.get(_HASH)
    if isinstance(cached, str):
        return cached
    # Without a distillation teacher: it is frozen too, but not the base. It is read from distill.teacher only once
    # the fit starts, after a resume checked the hash, so a distilled adapter run could never resume.
    exclude = getattr(module, "excluded_from_checkpoint", None)
    with exclude() if callable(exclude) else contextlib.nullcontext():
        value = base_state_hash(module)
    module.__dict__[_HASH] = value
    return value
