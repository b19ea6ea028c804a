"""Turn the Hydra config tree (the same groups as ``train.py``) into the planner's plain inputs."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.config.parallel_dims import parallel_dims_of
from lightning_trainopt.config.strategy import strategy_spec
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.metrics.hardware import HardwareSpec, hardware_spec
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.planner import (
    ActivationPolicy,
    LossPlan,
    ModelProfile,
    OptimizerStateModel,
    PlanInputs,
    SearchSpace,
    StrategyLayout,
    optimizer_state_model,
)

__all__ = [
    "NO_STRATEGY",
    "activation_policy",
    "build_plan_inputs",
    "check_compatible",
    "deepspeed_user_config",
    "hardware_from_cfg",
    "json_accumulation",
    "load_preset",
    "model_of",
    "optimizer_from_cfg",
    "search_space_from_cfg",
    "strategy_layout",
    "validate_like_train",
]


# The search's name for "no +strategy" (Lightning's single device): what the ddp preset stands for on one device.
NO_STRATEGY = "none"


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def deepspeed_user_config(node: Any) -> dict[str, Any] | None:
    """The user's DeepSpeed JSON of a strategy node (``strategy.config``: a path or a mapping), or ``None``.

    Lightning's ``DeepSpeedStrategy`` uses such a config as is and ignores its own ``stage``/``offload_*`` arguments,
    so the planner reads the JSON, as the builder does (both through :func:`parse_strategy`).

    Raises:
        ConfigError: ``strategy.config`` is missing (``???``), not a readable JSON object, or neither path nor mapping.
    """
    config = strategy_spec(node).config
    return None if config is None else copy.deepcopy(dict(config))


def strategy_layout(node: Any, world_size: int) -> StrategyLayout:
    """The layout of a ``conf/strategy`` preset node (``None``: Lightning's default for ``world_size`` devices).

    The node is read by :func:`parse_strategy`, as ``train.py``'s builder reads it: a DeepSpeed node with ``config``
    (``+strategy=deepspeed_json strategy.config=FILE``) from the JSON, with DeepSpeed's defaults for what the JSON
    leaves out; a preset from its keyword arguments, with the strategy class's defaults. A DDP preset stays DDP on
    one device too (Lightning wraps the model in DDP whatever the world).

    Raises:
        ConfigError: a strategy the planner does not model, or a bad value in the strategy node or its JSON.
    """
    return strategy_spec(node).layout(world_size)


def activation_policy(node: Any, name: str = "none") -> ActivationPolicy:
    """The policy of a ``conf/activations`` preset: every ``_target_`` in it is read for what it changes."""
    every, offload, bits, block, min_numel = 0, False, None, 64, 1024
    for d in _walk(_plain(node) or {}):
        target = str(d.get("_target_", "")).lower()
        if "checkpoint" in target:
            every = int(next((x["every_k"] for x in _walk(d) if "every_k" in x), 1))
        elif "offload" in target:
            offload = True
        elif "compression" in target or "compress" in target:
            bits = int(d.get("bits", 8))
            block = int(d.get("block_size", block))
            min_numel = int(d.get("min_numel", min_numel))
    return ActivationPolicy(every, offload, bits, block, min_numel, name=name)


def optimizer_from_cfg(node: Any, name: str | None = None) -> OptimizerStateModel:
    """The state model of a ``conf/optimizer`` preset."""
    node = _plain(node) or {}
    return optimizer_state_model(str(node.get("_target_", "torch.optim.AdamW")), name)


def hardware_from_cfg(node: Any) -> HardwareSpec:
    """The :class:`HardwareSpec` of a ``conf/hardware`` preset.

    The preset's ``_target_`` is called directly rather than through Hydra's ``instantiate``, which would wrap our
    :class:`ConfigError` (a negative price, a negative peak) in an ``InstantiationException``.

    Raises:
        ConfigError: a non-numeric or out-of-range override (``hardware.price_per_device_hour``, ``memory_gb``,
            ``host_memory_gb``, ``peak_tflops``) or an unknown device name.
    """
    node = _plain(node) or {}
    for key in ("price_per_device_hour", "memory_gb", "host_memory_gb"):
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"hardware.{key}", value, "use a number (or null for the preset's figure).")
    peaks = node.get("peak_tflops")
    if peaks is not None and not isinstance(peaks, dict):
        raise ConfigError("hardware.peak_tflops", peaks, "use a mapping of dtype to TFLOP/s, e.g. {bf16: 800}.")
    keys: tuple[str, ...] = ("name", "price_per_device_hour", "peak_tflops", "memory_gb", "host_memory_gb")
    keys += ("pcie_gb_per_s", "memory_gb_per_s", "nvme_gb_per_s", "cpu_adam_params_per_s")  # checked by hardware_spec
    keys += ("nvlink_gb_per_s", "network_gb_per_s")
    kwargs = {k: node[k] for k in keys if k in node}
    target = node.get("_target_")
    if target and not str(target).endswith("hardware_spec"):
        from hydra.utils import get_method

        spec = get_method(str(target))(**{k: v for k, v in node.items() if not k.startswith("_")})
        if isinstance(spec, HardwareSpec):
            return spec
    return hardware_spec(**kwargs)


def load_preset(conf_dir: Path, group: str, name: str) -> DictConfig:
    """Read ``conf/<group>/<name>.yaml`` (following its own ``defaults`` within the group).

    Raises:
        ConfigError: no such preset.
    """
    path = conf_dir / group / f"{name}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        raise ConfigError(f"plan.search_space.{group}", name, f"use presets that exist: {', '.join(have)}.")
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise ConfigError(f"plan.search_space.{group}", name, "that preset is not a mapping; use a config-group file.")
    defaults = node.pop("defaults", [])
    base: Any = OmegaConf.create()
    for entry in defaults:
        if isinstance(entry, str) and entry != "_self_":
            base = OmegaConf.merge(base, load_preset(conf_dir, group, entry))
    merged = OmegaConf.merge(base, node)
    assert isinstance(merged, DictConfig)
    return merged


def _positive(key: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, fix)
    return value


def json_accumulation(user_json: dict[str, Any], micro: int, world: int, accumulate: int) -> int:
    """The gradient accumulation ``train.py`` runs with a user DeepSpeed JSON.

    As ``parallel.builder`` and ``TrainOptDeepSpeedStrategy`` do: a ``train_batch_size`` fixes it to
    ``train_batch_size / (train_micro_batch_size_per_gpu (default data.batch_size) x world)`` when
    ``trainer.accumulate_grad_batches`` is 1, and must agree with it otherwise.

    Raises:
        ConfigError: ``gradient_accumulation_steps`` in the JSON (Lightning refuses it), or a ``train_batch_size``
            that the micro-batch, world size and accumulation cannot make.
    """
    from lightning_trainopt.parallel.deepspeed import TrainOptDeepSpeedStrategy

    if "gradient_accumulation_steps" in user_json:
        raise ConfigError(
            "strategy.config.gradient_accumulation_steps",
            user_json["gradient_accumulation_steps"],
            "remove it from the JSON: Lightning sets DeepSpeed's accumulation from trainer.accumulate_grad_batches "
            "(or from train_batch_size) and refuses the key.",
        )
    if "train_batch_size" not in user_json:
        return accumulate
    json_micro = user_json.get("train_micro_batch_size_per_gpu", micro)
    _positive("strategy.config.train_micro_batch_size_per_gpu", json_micro, "use a positive integer, or remove it.")
    return TrainOptDeepSpeedStrategy.accumulation_for_train_batch_size(
        user_json["train_batch_size"], json_micro, world, accumulate
    )


def validate_like_train(cfg: DictConfig) -> None:
    """Run ``train.py``'s per-key checks (``config.validate.validate_config``) on a config planned for other hardware.

    The checks about this machine (its CUDA device or core count, fp16 on its accelerator) do not apply to a plan
    for hardware it does not have, so they see a non-local accelerator; fp16 on planned CPU hardware is refused by
    :func:`check_compatible` (the pre-flight rule ``train.py`` applies).

    Raises:
        ConfigError: the value ``train.py`` refuses (``data.batch_size=2.5``, ``optimizer.lr=-1``, ...).
    """
    import copy

    from omegaconf import open_dict

    from lightning_trainopt.config.validate import validate_config

    _devices(cfg.trainer.get("devices", 1))  # the planner needs a count: no 'auto' or -1, unlike train.py
    planned = copy.deepcopy(cfg)
    OmegaConf.set_readonly(planned, False)
    with open_dict(planned):
        planned.trainer.accelerator = "planned"
    validate_config(planned)


def _devices(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, (list, tuple)) and value:
        return len(value)
    raise ConfigError(
        "trainer.devices", value, "the planner needs an explicit device count per node, e.g. trainer.devices=8."
    )


def check_compatible(
    strategy: Any,
    trainer_precision: str,
    optimizer_target: str | None,
    on_cuda: bool,
    callbacks: Any = None,
    precision: Any = None,
    adapter: str = "none",
    tensor_parallel: int = 1,
    data_parallel: int = 1,
) -> None:
    """Refuse what ``train.py``'s pre-flight refuses (``config.preflight.RULES``), for the planned hardware.

    The same rules run for the given config and for every search candidate, so ``plan.py`` refuses exactly what
    ``train.py`` refuses and the search enumerates exactly what it accepts. Rules about this machine
    (``Rule.machine_specific``: a system library) and the NVMe path checks are left to ``train.py`` on the machine
    that trains.

    Args:
        strategy: the ``strategy`` node (``None``: Lightning's default).
        trainer_precision: Lightning precision string.
        optimizer_target: the optimizer's ``_target_``.
        on_cuda: the planned hardware has CUDA devices (``hardware`` is not ``cpu``).
        callbacks: the ``callbacks`` node (for callback rules).
        precision: the ``precision`` node (for the FP8 and ``keep_fp32`` rules: ``fp8_te`` on a CPU, FP8 with FSDP1).
        adapter: ``adapter.kind``, checked against the adapter x strategy table (``parallel/compat_table.py``) at
            the ``tensor_parallel`` and ``data_parallel`` sizes.

    Raises:
        IncompatibleConfigError: the combination ``train.py`` would refuse, with its reason and fix.
    """
    from lightning_trainopt.config.preflight import RULES, PreflightInput, check_adapter_table

    # Only the callbacks' _target_ strings matter; resolving whole nodes would fail outside a Hydra run on
    # interpolations such as ${hydra:runtime.output_dir} (the notebook, the ladder's report callback).
    nodes = callbacks.values() if isinstance(callbacks, (DictConfig, dict)) else ()
    targets = tuple(str(v.get("_target_", "")) for v in nodes if isinstance(v, (DictConfig, dict)))
    node = _plain(precision) or {}
    backend = node.get("backend")
    p = PreflightInput(
        strategy=strategy_spec(strategy),
        precision=trainer_precision,
        optimizer_target=optimizer_target,
        accelerator="gpu" if on_cuda else "cpu",
        callback_targets=targets,
        precision_preset=node.get("name"),
        fp8_backend=backend,
        fp8_emulate=node.get("emulate"),
        transforms_model=backend is not None or (bool(node.get("keep_fp32")) and trainer_precision != "32-true"),
    )
    for rule in RULES:
        if not rule.machine_specific and rule.applies(p):
            raise IncompatibleConfigError(rule.keys(p), rule.reason, rule.fix)
    check_adapter_table(adapter, p.strategy.family_at(tensor_parallel, data_parallel), p.preset)


def _adapter_kind(cfg: DictConfig) -> str:
    from lightning_trainopt.config.preflight import adapter_kind

    return adapter_kind(cfg)


def model_of(cfg: DictConfig) -> GPTConfig | ModelProfile:
    """What the planner plans: our transformer's shape for its presets (planned analytically), else the
    :class:`ModelProfile` of the LightningModule ``cfg.model`` builds, on the meta device (``model=hf``,
    ``model=module``): parameters read from it, activations measured on fake tensors, FLOPs counted.

    Raises:
        ConfigError: a model node the app cannot build, or a module whose training step does not run on fake tensors.
    """
    from lightning_trainopt.config.model_factory import meta_module, model_kind, model_name

    if model_kind(cfg.model) == "gpt":
        node = _plain(cfg.model)
        node.pop("_target_", None)
        return GPTConfig(**node)
    from lightning_trainopt.config.plan_model import module_max_seq_len, module_plan_profile
    from lightning_trainopt.config.plan_precision import with_planned_loss

    module = with_planned_loss(meta_module(cfg), cfg)
    return module_plan_profile(module, model_name(cfg.model.get("name"), module), module_max_seq_len(module))


def _strategy_value(node: Any, key: str, default: Any) -> Any:
    """``strategy.<key>`` of a strategy node (``default`` without a node or the key)."""
    return node.get(key, default) if hasattr(node, "get") else default


def _flag(node: Any, key: str, default: bool) -> bool:
    value = _strategy_value(node, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"strategy.{key}", value, "use true or false.")
    return value


def build_plan_inputs(cfg: DictConfig, activations_name: str = "none") -> PlanInputs:
    """The planner's inputs for a composed ``train.py``/``plan.py`` config.

    Raises:
        ConfigError: a value the planner cannot plan (e.g. ``trainer.devices=-1``, a module whose training step does
            not run on fake tensors, ``trainer.accumulate_grad_batches=0``).
        IncompatibleConfigError: a combination ``train.py``'s pre-flight refuses (:func:`check_compatible`).
    """
    model = model_of(cfg)
    devices = _devices(cfg.trainer.get("devices", 1))
    nodes = _positive("trainer.num_nodes", cfg.trainer.get("num_nodes", 1), "use a positive whole node count.")
    micro = _positive("data.batch_size", cfg.data.batch_size, "use a positive micro-batch size per device.")
    seq_len = _positive("data.seq_len", cfg.data.seq_len, "use a positive sequence length.")
    spec = strategy_spec(cfg.get("strategy"))
    dims = parallel_dims_of(devices, nodes, cfg.get("strategy"))
    layout = spec.layout(devices * nodes)
    optimizer = optimizer_from_cfg(cfg.optimizer)
    trainer_precision = str(cfg.precision.trainer_precision)
    on_cuda = hardware_from_cfg(cfg.get("hardware")).name != "cpu"
    check_compatible(
        cfg.get("strategy"),
        trainer_precision,
        str(cfg.optimizer.get("_target_", "")),
        on_cuda,
        cfg.get("callbacks"),
        cfg.get("precision"),
        _adapter_kind(cfg),
        dims.tp,
        dims.dp,
    )
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches", accumulate, "use a positive integer (1 = no accumulation)."
        )
    if spec.config is not None:
        from lightning_trainopt.parallel.deepspeed_json import check_json_precision

        user_json = dict(spec.config)
        check_json_precision(user_json, trainer_precision)
        accumulate = json_accumulation(user_json, micro, dims.dp, accumulate)
    from lightning_trainopt.config.plan_precision import attention_kind, loss_plan, precision_plan

    return PlanInputs(
        model=model,
        trainer_precision=trainer_precision,
        layout=layout,
        optimizer=optimizer,
        activations=activation_policy(cfg.get("activations"), activations_name),
        micro_batch=micro,
        seq_len=seq_len,
        accumulate=accumulate,
        devices=devices,
        num_nodes=nodes,
        tensor_parallel=dims.tp,
        sequence_parallel=_flag(cfg.get("strategy"), "sequence_parallel", True),
        replicate=_positive(
            "strategy.replicate",
            _strategy_value(cfg.get("strategy"), "replicate", 1),
            "use a whole number of HSDP replicas (1: plain FSDP2).",
        ),
        attention=attention_kind(cfg),
        precision=precision_plan(cfg, cfg.precision, on_cuda),
        loss=loss_plan(cfg.get("loss")),
    )


def search_space_from_cfg(
    space_node: Any,
    conf_dir: Path,
    world_size: int,
    cfg: DictConfig | None = None,
    on_cuda: bool = False,
    known: dict[str, Any] | None = None,
) -> SearchSpace:
    """The :class:`SearchSpace` of ``plan.search_space``: every listed preset must exist, every list be non-empty.

    On one device the ``ddp`` preset stands for :data:`NO_STRATEGY` (Lightning's single device, no ``+strategy``):
    the DDP wrapper would only add its gradient buckets. With ``cfg``, each precision preset that changes the model
    (FP8, ``keep_fp32``) gets its :class:`PrecisionPlan` (``known``: those already made, by preset name), and an
    optional ``plan.search_space.loss`` list lets the search choose the loss (our GPT presets).

    Raises:
        ConfigError: a missing or empty list, an unknown preset (the key, the name and the presets that exist), a
            micro-batch that is not a positive whole number, or a loss list for a model other than our GPT presets.
    """
    space = _plain(space_node) or {}
    for group in ("precision", "strategy", "activations", "optimizer", "micro_batch"):
        value = space.get(group)
        if not isinstance(value, list) or not value:
            raise ConfigError(f"plan.search_space.{group}", value, "list at least one choice, e.g. [...].")
    precisions = {str(n): str(load_preset(conf_dir, "precision", str(n)).trainer_precision) for n in space["precision"]}
    strategies = {}
    for n in space["strategy"]:
        layout = strategy_layout(load_preset(conf_dir, "strategy", str(n)), world_size)
        if layout.ddp_buckets and world_size == 1:
            strategies[NO_STRATEGY] = replace(strategy_spec(None).layout(1), name=NO_STRATEGY)
        else:
            strategies[str(n)] = layout
    activations = {
        str(n): activation_policy(load_preset(conf_dir, "activations", str(n)), str(n)) for n in space["activations"]
    }
    optimizers = {
        str(n): optimizer_from_cfg(load_preset(conf_dir, "optimizer", str(n)), str(n)) for n in space["optimizer"]
    }
    micro = tuple(
        _positive("plan.search_space.micro_batch", b, "use positive whole micro-batch sizes, e.g. [1, 2, 4].")
        for b in space["micro_batch"]
    )
    tp = _sizes(space, "tensor_parallel", (1,))
    nodes = cfg.trainer.get("num_nodes", 1) if cfg is not None else 1
    replicate = _sizes(space, "replicate", (1, nodes) if isinstance(nodes, int) and nodes > 1 else (1,))
    if cfg is None:
        return SearchSpace(
            precisions, strategies, activations, optimizers, micro, tensor_parallel=tp, replicate=replicate
        )
    from lightning_trainopt.config.model_factory import model_kind
    from lightning_trainopt.config.plan_precision import loss_plan, precision_plan

    known = known or {}
    plans = {
        n: known[n] if n in known else precision_plan(cfg, load_preset(conf_dir, "precision", n), on_cuda, n)
        for n in precisions
    }
    losses = {}
    if space.get("loss") is not None:
        names = space["loss"]
        if not isinstance(names, list) or not names:
            raise ConfigError(
                "plan.search_space.loss", names, "list at least one loss preset, e.g. [standard, chunked_ce]."
            )
        if model_kind(cfg.model) != "gpt":
            raise ConfigError(
                "plan.search_space.loss",
                names,
                "the search chooses the loss for our GPT presets; for this model plan each loss=... in turn.",
            )
        for n in names:
            plan = loss_plan(load_preset(conf_dir, "loss", str(n)), str(n))
            losses[str(n)] = plan if plan is not None else LossPlan(str(n))
    return SearchSpace(precisions, strategies, activations, optimizers, micro, plans, losses, tp, replicate)


def _sizes(space: dict[str, Any], group: str, auto: tuple[int, ...]) -> tuple[int, ...]:
    """``plan.search_space.<group>`` as positive whole sizes; missing, ``null`` or ``auto``: ``auto``.

    Raises:
        ConfigError: an empty list or a size that is not a positive whole number.
    """
    value = space.get(group)
    if value is None or value == "auto":
        return tuple(dict.fromkeys(auto))
    fix = f"list positive whole sizes, e.g. plan.search_space.{group}=[1,2,4,8]."
    if not isinstance(value, list) or not value:
        raise ConfigError(f"plan.search_space.{group}", value, fix)
    return tuple(dict.fromkeys(_positive(f"plan.search_space.{group}", v, fix) for v in value))
