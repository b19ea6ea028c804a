"""Resuming an adapter or distillation run: the command must build what the checkpoint was trained as.

Checked against the checkpoint's saved state before anything is built (``train.py`` calls
:func:`check_resume_matches` beside :func:`~lightning_trainopt.checkpoint.resume_check.check_resume`), so that a
changed ``adapter.r``, a switch between ``adapter=none`` and ``adapter=lora``, another base model shape or another
distillation teacher ends with one error naming the key, both values and the fix, instead of Lightning's
``size mismatch`` traceback (or, worse, adapters silently loaded onto another base). What the config cannot show (the
files under ``model.pretrained`` rewritten, another seed building the base) is still caught when the checkpoint is
loaded, by the frozen base's SHA-256 (:func:`~lightning_trainopt.checkpoint.adapter_state.restore_frozen_base`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning_trainopt.checkpoint.adapter_state import ADAPTER_KEY
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.distill import TEACHER_RECORD
from lightning_trainopt.transforms.adapters import AdapterSpec, describe

__all__ = ["TEACHER_KEY", "check_resume_matches"]

#: The checkpoint entry where a distilled student records its teacher.
TEACHER_KEY = TEACHER_RECORD

# What an adapter's saved tensors or its training depend on; dropout is a regularisation setting a user may change.
_ADAPTER_FIELDS = ("kind", "r", "alpha", "target_modules")
_QLORA_FIELDS = ("quant_type", "double_quant")
# Model fields that change neither the base's weights nor what the adapters were trained against: the attention
# kernel, the name metrics.json shows, the longest sequence the rotary cache is built for.
_RUNTIME_FIELDS = frozenset({"name", "attention", "attn_implementation", "max_seq_len"})
_PATH_FIELDS = frozenset({"pretrained", "config"})
_NEW_RUN = "or start a new run (ckpt_path=null, or another hydra.run.dir)"


def _same(key: str, a: Any, b: Any) -> bool:
    if key in _PATH_FIELDS and isinstance(a, str) and isinstance(b, str):
        return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return bool(a == b)


def _check_adapter(ckpt_path: str, record: Any, adapter: AdapterSpec) -> None:
    if not isinstance(record, Mapping):
        if adapter.enabled:
            raise ConfigError(
                "adapter",
                adapter.kind,
                f"ckpt_path={ckpt_path} is of a run without an adapter (full fine-tuning: its optimizer holds the "
                "whole model); resume it with adapter=none, or train adapters in a new run (ckpt_path=null) on its "
                "weights exported with trainopt-export --format hf and given as model=hf model.pretrained=DIR.",
            )
        return
    spec = record.get("spec")
    saved: Mapping[str, Any] = spec if isinstance(spec, Mapping) else {}
    if not adapter.enabled:
        raise ConfigError(
            "adapter",
            "none",
            f"ckpt_path={ckpt_path} holds adapter={saved.get('kind')} (r={saved.get('r')}) without its frozen base, "
            f"not a whole model; resume with adapter={saved.get('kind')}, or merge it into its base with "
            "trainopt-export and start a new run from that.",
        )
    fields = _ADAPTER_FIELDS + (_QLORA_FIELDS if adapter.kind == "qlora" else ())
    current = describe(adapter)
    for field in fields:
        if field in saved and not _same(field, saved[field], current[field]):
            # The kind is chosen with the config group (adapter=lora), the rest with its keys.
            fix = f"adapter={saved[field]}" if field == "kind" else f"adapter.{field}={saved[field]!r}"
            raise ConfigError(
                f"adapter.{field}",
                current[field],
                f"ckpt_path={ckpt_path} was trained with adapter.{field}={saved[field]!r}; resume with {fix}, "
                f"{_NEW_RUN}.",
            )


def _check_base(ckpt_path: str, record: Any, model: Mapping[str, Any], seed: int | None) -> None:
    if not isinstance(record, Mapping):
        return
    recorded = record.get("rebuild")
    rebuild: Mapping[str, Any] = recorded if isinstance(recorded, Mapping) else {}
    saved = rebuild.get("model")
    if not isinstance(saved, Mapping):  # a user's LightningModule: the base's hash on load is the check
        return
    for key in sorted(set(saved) & set(model)):
        if key.startswith("_") or key in _RUNTIME_FIELDS:
            continue
        if not _same(key, saved[key], model[key]):
            raise ConfigError(
                f"model.{key}",
                model[key],
                f"the adapters in ckpt_path={ckpt_path} were trained on a base with model.{key}={saved[key]!r}; "
                f"resume with model.{key}={saved[key]!r} (the base must be the same), {_NEW_RUN}.",
            )
    # A base without pretrained weights is the seed's random initialisation: another seed builds another base.
    recorded_seed = rebuild.get("seed")
    if not saved.get("pretrained") and recorded_seed is not None and seed is not None and str(seed) != recorded_seed:
        raise ConfigError(
            "seed",
            seed,
            f"the adapters in ckpt_path={ckpt_path} were trained on a base initialised with seed={recorded_seed} "
            f"(no model.pretrained); resume with seed={recorded_seed}, {_NEW_RUN}.",
        )


def _check_teacher(ckpt_path: str, record: Any, teacher: str | None) -> None:
    if not isinstance(record, Mapping) or teacher is None:
        return
    from lightning_trainopt.checkpoint.teacher import fingerprint

    if not os.path.exists(teacher):
        return  # teacher_source refuses a missing teacher with its own message when the run is built
    if fingerprint(teacher) != record.get("fingerprint"):
        raise ConfigError(
            "distill.teacher",
            teacher,
            f"is not the teacher ckpt_path={ckpt_path} was distilled from ({record.get('path')}, fingerprint "
            f"{str(record.get('fingerprint'))[:12]}...: another file, or its files changed since); resume with that "
            f"teacher, {_NEW_RUN}.",
        )


def check_resume_matches(
    ckpt_path: str,
    adapter: AdapterSpec,
    model: Mapping[str, Any],
    seed: int | None,
    distill: Mapping[str, Any] | None,
) -> None:
    """Refuse a resume whose command would build another adapter, base or teacher than the checkpoint's.

    Args:
        ckpt_path: the checkpoint to resume from (checked complete already).
        adapter: the run's ``adapter`` group.
        model: the run's ``model`` node (plain values).
        seed: the run's ``seed``.
        distill: the ``distill`` node of an ``experiment=distill`` run, else ``None``.

    Raises:
        ConfigError: naming ``adapter`` / ``adapter.<field>``, ``model.<field>``, ``seed`` or ``distill.teacher``,
            the value given, the checkpoint's, and the fix.
    """
    from lightning_trainopt.checkpoint.verify import read_checkpoint_state

    state = read_checkpoint_state(ckpt_path)
    record = state.get(ADAPTER_KEY)
    _check_adapter(ckpt_path, record, adapter)
    _check_base(ckpt_path, record, model, seed)
    teacher = (distill or {}).get("teacher")
    _check_teacher(ckpt_path, state.get(TEACHER_KEY), teacher if isinstance(teacher, str) else None)
