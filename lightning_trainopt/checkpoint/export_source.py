"""Where ``trainopt-export`` reads a checkpoint: which file or directory, its tensors gathered on one process, the
frozen base an adapter run left out rebuilt and checked, and the adapter settings the run recorded.

The sharded forms are read as ``trainopt-convert`` reads them: a DCP directory (FSDP2/TP) with
:func:`~lightning_trainopt.checkpoint.dcp.read_dcp_tensors`, a DeepSpeed ZeRO directory with Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` (ZeRO-3's partitions, frozen parameters included), whatever the number
of ranks that wrote them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_trainopt.checkpoint.adapter_state import ADAPTER_KEY
from lightning_trainopt.checkpoint.convert import _strip
from lightning_trainopt.checkpoint.dcp import is_dcp_checkpoint, read_dcp_tensors
from lightning_trainopt.checkpoint.state import lightning_state
from lightning_trainopt.checkpoint.verify import checkpoint_problem, newest_complete_checkpoint
from lightning_trainopt.exceptions import ConfigError

__all__ = ["PEFT_PREFIX", "read_checkpoint", "recorded_adapter", "resolve_checkpoint"]

#: The names a ``get_peft_model`` wrapper puts in front of the model's own.
PEFT_PREFIX = "base_model.model."


_FIX = "export another checkpoint (a run folder gives its newest complete one)."


def _is_run_folder(path: Path) -> bool:
    return path.is_dir() and (path / "checkpoints").is_dir() and not is_dcp_checkpoint(path)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself, or for a run folder (it holds ``checkpoints/``) its newest complete checkpoint.

    Raises:
        ConfigError: ``path`` does not exist, is no checkpoint, is incomplete (a truncated file, a directory without
            its manifest or with a file of the wrong size), or is a run folder without a complete checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            "checkpoint",
            os.fspath(path),
            "it does not exist; give a .ckpt file, a checkpoint directory or a run folder.",
        )
    if _is_run_folder(path):
        try:
            return Path(newest_complete_checkpoint(path / "checkpoints"))
        except ConfigError as err:
            raise ConfigError("checkpoint", os.fspath(path), err.fix) from err
    if path.is_dir() and not is_dcp_checkpoint(path) and not (path / "checkpoint").is_dir():
        raise ConfigError(
            "checkpoint",
            os.fspath(path),
            "a directory that is neither a DeepSpeed checkpoint (checkpoint/) nor a DCP one (.metadata) nor a run "
            "folder (checkpoints/); give one of them or a .ckpt file.",
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError("checkpoint", os.fspath(path), f"{problem}; {_FIX}")
    return path


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's weights under the LightningModule's names, and Lightning's top-level dict around them."""
    if is_dcp_checkpoint(path):
        return read_dcp_tensors(path, "state_dict."), dict(lightning_state(path))
    if path.is_dir():
        import tempfile

        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        # Every rank's partitions gathered into fp32 (ZeRO-3's frozen parameters included), with Lightning's state.
        with tempfile.TemporaryDirectory() as tmp:
            full = convert_zero_checkpoint_to_fp32_state_dict(os.fspath(path), os.path.join(tmp, "full.ckpt"))
        return full["state_dict"], full
    try:
        full = dict(lightning_state(path))
    except Exception as err:  # torch.load's errors are RuntimeError, UnpicklingError, EOFError, ...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("checkpoint", os.fspath(path), f"it cannot be read ({reason}); {_FIX}") from err
    if not isinstance(full.get("state_dict"), dict):
        raise ConfigError(
            "checkpoint", os.fspath(path), "the file holds no Lightning state_dict; give a checkpoint a Trainer wrote."
        )
    return full["state_dict"], full


def read_checkpoint(path: Path, need_base: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's weights (keyed like the model's ``state_dict()``; with ``need_base`` the frozen base rebuilt
    where the run left it out) and its hyper-parameters (``adapter``: the adapter's settings where recorded)."""
    state, top = _load(path)
    hyper = dict(top.get("hyper_parameters") or {})
    record = top.get(ADAPTER_KEY)
    if isinstance(record, dict):
        hyper.setdefault("adapter", record.get("spec"))
        adapters = set(record.get("adapter_tensors") or ())
        if need_base and len(set(state) - adapters) < int(record.get("base_tensors_left_out") or 0):
            # The checkpoint's own tensors win over the rebuilt ones (the adapters, whatever else it kept).
            state = {**_rebuild_base(path, record), **state}
    state = _strip(state)
    # A get_peft_model wrapper's names; the rebuilt model carries the adapters in place.
    return {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}, hyper


def _rebuild_base(path: Path, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The frozen base an adapter run left out of its checkpoint, built again as the run built it (its module class
    with the recorded model node, from the recorded seed, the adapter applied: QLoRA's 4-bit base included) and
    checked against the recorded SHA-256.

    Raises:
        ConfigError: a module that is not one of our presets or ``model=hf``, or a rebuilt base that differs (other
            ``model.pretrained`` files, another version of the model's code).
    """
    from lightning_trainopt.models import LitCausalLM, LitGPT
    from lightning_trainopt.transforms.adapters import AdapterSpec, apply_adapter, base_state_hash, frozen_base_names

    rebuild = record.get("rebuild") or {}
    classes = {f"{c.__module__}.{c.__qualname__}": c for c in (LitGPT, LitCausalLM)}
    cls = classes.get(str(rebuild.get("module")))
    if cls is None or not isinstance(rebuild.get("model"), dict) or rebuild.get("seed") is None:
        raise ConfigError(
            "checkpoint",
            os.fspath(path),
            f"its frozen base was left out (an adapter run of {rebuild.get('module')}) and is rebuilt here only for "
            "our GPT presets and model=hf; export with the base: load the checkpoint into your module, then "
            "merge with peft, or export --format peft (the adapter alone).",
        )
    spec = dict(record.get("spec") or {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(rebuild["seed"]))
        module = cls(rebuild["model"])
        module.configure_model()
    apply_adapter(module, AdapterSpec(**spec))
    if base_state_hash(module) != record.get("base_sha256"):
        raise ConfigError(
            "checkpoint",
            os.fspath(path),
            f"its frozen base was left out and the base rebuilt from model {rebuild['model']} with seed "
            f"{rebuild['seed']} is not the one the adapters were trained on (SHA-256 differs); export where the run's "
            "model.pretrained files and code version are, or export --format peft (the adapter alone).",
        )
    base = set(frozen_base_names(module))
    return {k: v for k, v in module.state_dict().items() if k in base}


def recorded_adapter(checkpoint: Path, hyper: dict[str, Any]) -> dict[str, Any]:
    """The adapter settings the run recorded: the checkpoint's hyper-parameters (``adapter``), else the run folder's
    ``.hydra/config.yaml`` (``adapter`` node); ``{}`` when neither has them."""
    recorded = hyper.get("adapter")
    if isinstance(recorded, dict):
        return recorded
    for folder in list(checkpoint.parents)[:3]:
        config = folder / ".hydra" / "config.yaml"
        if config.is_file():
            import yaml

            node = (yaml.safe_load(config.read_text()) or {}).get("adapter")
            return node if isinstance(node, dict) else {}
    return {}
