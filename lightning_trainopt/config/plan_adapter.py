"""The planner's adapter and teacher inputs from the composed config: ``adapter=lora|qlora`` (the ``adapter`` node),
``plan.adapters=true`` (the search may choose one) and ``plan.teacher`` (a distillation teacher)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.flops import teacher_forward_flops
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import ModelProfile, StrategyLayout
from lightning_trainopt.planner.adapter_targets import module_adapter_plan
from lightning_trainopt.planner.adapters import AdapterPlan, gpt_adapter_plan
from lightning_trainopt.planner.teacher import TeacherPlan, gpt_teacher_plan
from lightning_trainopt.transforms.adapters import default_target_modules

__all__ = ["adapter_plan", "adapter_plans_to_search", "adapter_refused", "check_teacher_split", "teacher_plan"]

#: What the search plans for an adapter the user did not configure: the QLoRA paper's rank and targets (every linear
#: layer of the blocks), no dropout.
_SEARCH_RANK = 16
_STORAGE_BYTES = {"uint8": 1, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _node(cfg: DictConfig) -> dict[str, Any]:
    node = _plain(cfg.get("adapter")) or {}
    if not isinstance(node, dict):
        raise ConfigError("adapter", node, "use adapter=none|lora|qlora.")
    return node


def _targets(node: dict[str, Any]) -> list[str] | None:
    targets = node.get("target_modules")
    if targets is None:
        return None
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise ConfigError("adapter.target_modules", targets, "list the linear layers' names, e.g. [q_proj, v_proj].")
    return [str(t) for t in targets]


def _make(kind: str, node: dict[str, Any], model: GPTConfig | ModelProfile, cfg: DictConfig) -> AdapterPlan:
    r = node.get("r", _SEARCH_RANK)
    dropout = float(node.get("dropout", 0.0) or 0.0)
    double_quant = bool(node.get("double_quant", True))
    storage = str(node.get("quant_storage", "bfloat16")).removeprefix("torch.")
    if storage not in _STORAGE_BYTES:
        raise ConfigError("adapter.quant_storage", storage, f"use one of {', '.join(_STORAGE_BYTES)}.")
    targets = _targets(node)
    if isinstance(model, GPTConfig):
        return gpt_adapter_plan(model, kind, r, targets, dropout, double_quant, _STORAGE_BYTES[storage])
    from lightning_trainopt.config.model_factory import meta_module

    module = meta_module(cfg)
    return module_adapter_plan(
        module,
        kind,
        r,
        targets if targets is not None else list(default_target_modules(module)),
        dropout,
        double_quant,
        _STORAGE_BYTES[storage],
    )


def adapter_plan(cfg: DictConfig, model: GPTConfig | ModelProfile) -> AdapterPlan | None:
    """The configured adapter (``adapter.kind``; ``none`` or no ``adapter`` node: ``None``).

    Raises:
        ConfigError: an unknown kind, a rank that is not a positive whole number, target names the model lacks.
    """
    node = _node(cfg)
    kind = str(node.get("kind", "none"))
    if kind == "none":
        return None
    return _make(kind, node, model, cfg)


def adapter_plans_to_search(cfg: DictConfig, model: GPTConfig | ModelProfile) -> dict[str, AdapterPlan | None]:
    """``plan.adapters=true``: ``none``, ``lora`` and ``qlora`` with the configured rank and targets (rank 16 and
    every block linear layer when none is configured); ``false``: only the configured adapter, not a choice.

    Raises:
        ConfigError: ``plan.adapters`` is not a boolean.
    """
    allow = (cfg.get("plan") or {}).get("adapters", False)
    if not isinstance(allow, bool):
        raise ConfigError("plan.adapters", allow, "use true (the search may train through an adapter) or false.")
    if not allow:
        return {}
    node = _node(cfg)
    return {"none": None, **{kind: _make(kind, node, model, cfg) for kind in ("lora", "qlora")}}


def adapter_refused(kind: str | None, layout: StrategyLayout, tensor_parallel: int, data_parallel: int) -> bool:
    """Whether the adapter x strategy table (``parallel/compat_table.py`` ``adapter_cell``) refuses ``kind`` with this
    strategy: the search then skips the pair, as ``train.py``'s pre-flight refuses it."""
    if kind in (None, "none"):
        return False
    from lightning_trainopt.parallel.compat_table import adapter_cell, family_of_layout

    family = family_of_layout(layout, tensor_parallel, data_parallel)
    return family is not None and adapter_cell(kind, family) is not None


def _hf_teacher(path: Path, seq_len: int) -> TeacherPlan:
    """A local Hugging Face model directory's teacher: its parameters read from the model built on the meta device,
    its forward FLOPs as SpeedMonitor counts them (``metrics.flops.teacher_forward_flops``: 2 per parameter per
    token)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    numels = tuple(p.numel() for p in model.parameters())
    per_token = teacher_forward_flops(1, seq_len, n_params=sum(numels)) / seq_len
    return TeacherPlan(str(getattr(config, "model_type", path.name)), numels, per_token, int(config.hidden_size))


def teacher_plan(cfg: DictConfig, conf_dir: Path, seq_len: int) -> TeacherPlan | None:
    """The distillation teacher to plan: ``plan.teacher`` (one of our GPT model presets, ``gpt_350m``), else under
    ``experiment=distill`` the ``distill.teacher_model`` node (a ``GPTConfig``) or a local Hugging Face model directory
    ``distill.teacher``; ``None`` without one. (Our ``.ckpt``/ZeRO/DCP teachers without ``distill.teacher_model`` are
    not read: name their shape with ``plan.teacher``.)

    Raises:
        ConfigError: ``plan.teacher`` is not a model preset of ours.
    """
    name = (cfg.get("plan") or {}).get("teacher")
    if name is None:
        return _distill_teacher(cfg, seq_len)
    path = conf_dir / "model" / f"{name}.yaml"
    node = _plain(OmegaConf.load(path)) if path.is_file() else None
    if not isinstance(node, dict) or not str(node.get("_target_", "")).endswith("GPTConfig"):
        presets = sorted(p.stem for p in (conf_dir / "model").glob("*.yaml"))
        raise ConfigError("plan.teacher", name, f"name one of our GPT model presets: {', '.join(presets)}.")
    node.pop("_target_")
    return gpt_teacher_plan(GPTConfig(**node), seq_len)


def _distill_teacher(cfg: DictConfig, seq_len: int) -> TeacherPlan | None:
    distill = _plain(cfg.get("distill")) or {}
    if not isinstance(distill, dict):
        return None
    node = distill.get("teacher_model")
    if isinstance(node, dict) and str(node.get("_target_", "")).endswith("GPTConfig"):
        node = {k: v for k, v in node.items() if k != "_target_"}
        return gpt_teacher_plan(GPTConfig(**node), seq_len)
    source = distill.get("teacher")
    if isinstance(source, str) and (Path(source) / "config.json").is_file():
        return _hf_teacher(Path(source), seq_len)
    return None


def check_teacher_split(cfg: DictConfig, tensor_parallel: int) -> None:
    """Under ``experiment=distill`` with TP > 1, refuse the teacher ``train.py`` refuses: one the student's
    tensor-parallel plan cannot split (:func:`~lightning_trainopt.config.distill.check_teacher_tensor_parallel`, the
    same rule and message). The teacher's shape is read as :func:`teacher_plan` reads it: a ``GPTConfig``
    ``distill.teacher_model`` node or a local Hugging Face directory's ``config.json``; our ``.ckpt``/ZeRO/DCP
    teachers are not opened here (``train.py`` checks them when it reads them, before spawning).

    Raises:
        IncompatibleConfigError: naming ``distill.teacher`` and ``strategy.tensor_parallel_size``.
    """
    distill = _plain(cfg.get("distill")) or {}
    if tensor_parallel <= 1 or not isinstance(distill, dict):
        return
    from lightning_trainopt.config.distill import check_teacher_tensor_parallel
    from lightning_trainopt.models.hf_config import HFModelConfig

    node, source = distill.get("teacher_model"), distill.get("teacher")
    config: GPTConfig | HFModelConfig
    if isinstance(node, dict) and str(node.get("_target_", "")).endswith("GPTConfig"):
        config = GPTConfig(**{k: v for k, v in node.items() if k != "_target_"})
    elif node is None and isinstance(source, str) and (Path(source) / "config.json").is_file():
        config = HFModelConfig(pretrained=source)
    else:
        return
    check_teacher_tensor_parallel(config, str(source), tensor_parallel)
