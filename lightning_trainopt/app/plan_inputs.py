"""Turn the Hydra config tree (the same groups as ``train.py``) into the planner's plain inputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.core.estimate import (
    ActivationPolicy,
    OptimizerStateModel,
    PlanInputs,
    SearchSpace,
    StrategyLayout,
    optimizer_state_model,
)
from lightning_trainopt.core.estimate.model_states import MODEL_SIZED_BUCKET_CAP
from lightning_trainopt.core.estimate.zero_infinity import check_optimizer_swap_buffers
from lightning_trainopt.core.hardware import HardwareSpec, hardware_spec
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.models.config import GPTConfig

__all__ = [
    "NO_STRATEGY",
    "activation_policy",
    "build_plan_inputs",
    "check_compatible",
    "deepspeed_user_config",
    "hardware_from_cfg",
    "json_accumulation",
    "load_preset",
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


def _whole(key: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``; integral floats (``5e8`` in a JSON) pass, fractions and text do not.

    Raises:
        ConfigError: not a whole number, or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
        raise ConfigError(key, value, f"use a whole number >= {minimum}.")
    return int(value)


def deepspeed_user_config(node: Any) -> dict[str, Any] | None:
    """The user's DeepSpeed JSON of a strategy node (``strategy.config``: a path or a mapping), or ``None``.

    Lightning's ``DeepSpeedStrategy`` uses such a config as is and ignores its own ``stage``/``offload_*`` arguments,
    so the planner must read the JSON, as ``strategies.builder`` does (``load_deepspeed_json``).

    Raises:
        ConfigError: ``strategy.config`` is missing (``???``), not a readable JSON object, or neither path nor mapping.
    """
    node = _plain(node) or {}
    config = node.get("config")
    if config is None:
        return None
    if config == "???":
        raise ConfigError(
            "strategy.config", "???", "this preset needs it: add strategy.config=PATH.json to the command."
        )
    if isinstance(config, dict):
        return config
    if isinstance(config, str):
        from lightning_trainopt.strategies.deepspeed_json import load_deepspeed_json

        return load_deepspeed_json(config)
    raise ConfigError("strategy.config", config, "give the path of a DeepSpeed JSON file.")


def _offload_device(zero: dict[str, Any], block: str, legacy: str) -> str:
    """``none``/``cpu``/``nvme`` of ``zero_optimization.<block>.device`` (DeepSpeed's default ``none``)."""
    key = f"strategy.config.zero_optimization.{block}"
    node = zero.get(block)
    if node is None:
        # DeepSpeed still maps the deprecated booleans (cpu_offload, cpu_offload_param) onto the CPU.
        return "cpu" if zero.get(legacy) else "none"
    if not isinstance(node, dict):
        raise ConfigError(key, node, 'use a mapping such as {"device": "cpu"}.')
    device = str(node.get("device", "none"))
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{key}.device", device, "use none, cpu or nvme.")
    ratio = node.get("ratio", 1.0)
    if ratio != 1.0:
        raise ConfigError(
            f"{key}.ratio", ratio, "the planner models whole offload only; remove ratio (or set 1.0) to plan the run."
        )
    return device


def _json_layout(name: str, ds: dict[str, Any]) -> StrategyLayout:
    """The layout of a user DeepSpeed JSON, with DeepSpeed's own defaults (``runtime/zero/config.py``) for what it
    leaves out: Lightning's defaults (2e8 buckets, ``overlap_comm``) apply only to its keyword arguments."""
    zero = ds.get("zero_optimization") or {}
    key = "strategy.config.zero_optimization"
    if not isinstance(zero, dict):
        raise ConfigError(key, zero, 'use a mapping such as {"stage": 2}.')
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ConfigError(
            f"{key}.stage",
            stage,
            "the planner models ZeRO stages 1, 2 and 3 (DeepSpeed's default 0 is no ZeRO); set the stage in the JSON.",
        )

    def count(field: str, default: int, alias: str | None = None, minimum: int = 0) -> int:
        # DeepSpeed's pydantic model accepts a field's name and its alias (populate_by_name).
        for k in (alias, field):
            if k and k in zero:
                return _whole(f"{key}.{k}", zero[k], minimum)
        return default

    overlap = zero.get("overlap_comm")
    contiguous = zero.get("contiguous_gradients", True)
    opt_swap = _offload_block(zero, "offload_optimizer")
    param_swap = _offload_block(zero, "offload_param")

    def swap(block: dict[str, Any], name: str, field: str, default: int, minimum: int) -> int:
        return _whole(f"{key}.{name}.{field}", block[field], minimum) if field in block else default

    if opt_swap.get("device") == "nvme" and "buffer_count" in opt_swap:
        check_optimizer_swap_buffers(f"{key}.offload_optimizer.buffer_count", opt_swap["buffer_count"])

    return StrategyLayout(
        name=name,
        kind="deepspeed",
        zero_stage=int(stage),
        offload_optimizer=_offload_device(zero, "offload_optimizer", "cpu_offload"),
        offload_params=_offload_device(zero, "offload_param", "cpu_offload_param"),
        reduce_bucket_size=count("reduce_bucket_size", 500_000_000, minimum=1),
        param_persistence_threshold=count(
            "param_persistence_threshold", 100_000, alias="stage3_param_persistence_threshold"
        ),
        # DeepSpeed's validator: overlap_comm defaults to True for stage 3 only.
        overlap_comm=bool(stage == 3 if overlap is None else overlap),
        contiguous_gradients=bool(contiguous),
        prefetch_bucket_size=count("prefetch_bucket_size", 50_000_000, alias="stage3_prefetch_bucket_size"),
        max_live_parameters=count("max_live_parameters", 1_000_000_000, alias="stage3_max_live_parameters"),
        max_reuse_distance=count("max_reuse_distance", 1_000_000_000, alias="stage3_max_reuse_distance"),
        # DeepSpeed's defaults (runtime/zero/config.py, offload_config.py): 1e9-element sub-groups, unlike Lightning.
        sub_group_size=count("sub_group_size", 1_000_000_000),
        optimizer_buffer_count=swap(opt_swap, "offload_optimizer", "buffer_count", 4, 1),
        params_buffer_count=swap(param_swap, "offload_param", "buffer_count", 5, 1),
        params_buffer_size=swap(param_swap, "offload_param", "buffer_size", 100_000_000, 1),
        max_in_cpu=swap(param_swap, "offload_param", "max_in_cpu", 1_000_000_000, 0),
    )


def _bucket(node: dict[str, Any]) -> int:
    """``strategy.reduce_bucket_size`` in elements (Lightning's default 2e8); ``auto`` gives the cap of the bucket
    that :class:`StrategyLayout` sizes to the model (``buckets_sized_to_model``)."""
    value = node.get("reduce_bucket_size", 200_000_000)
    return MODEL_SIZED_BUCKET_CAP if value == "auto" else _whole("strategy.reduce_bucket_size", value)


def _offload_block(zero: dict[str, Any], block: str) -> dict[str, Any]:
    """``zero_optimization.<block>`` as a mapping (``{}`` when absent; its type is checked by ``_offload_device``)."""
    node = zero.get(block)
    return node if isinstance(node, dict) else {}


def strategy_layout(node: Any, world_size: int) -> StrategyLayout:
    """The layout of a ``conf/strategy`` preset node (``None``: Lightning's default for ``world_size`` devices).

    A DeepSpeed node with ``config`` (``+strategy=deepspeed_json strategy.config=FILE``) is read from the JSON, as
    Lightning does; a DDP preset stays DDP on one device too (Lightning wraps the model in DDP whatever the world).

    Raises:
        ConfigError: a strategy the planner does not model, or a bad value in the strategy node or its JSON.
    """
    node = _plain(node)
    if not node:
        return StrategyLayout(name="ddp" if world_size > 1 else "single", kind="ddp" if world_size > 1 else "single")
    target = str(node.get("_target_", ""))
    name = str(node.get("name") or target.rsplit(".", 1)[-1])
    if "deepspeed" in target.lower() or "stage" in node:
        user_json = deepspeed_user_config(node)
        if user_json is not None:
            return _json_layout(name, user_json)
        off_opt = "none"
        if node.get("offload_optimizer"):
            off_opt = str(node.get("offload_optimizer_device", "cpu"))
        off_par = "none"
        if node.get("offload_parameters"):
            off_par = str(node.get("offload_params_device", "cpu"))
        if off_opt == "nvme" and "optimizer_buffer_count" in node:
            check_optimizer_swap_buffers("strategy.optimizer_buffer_count", node["optimizer_buffer_count"])
        # TrainOptDeepSpeedStrategy keeps ZeRO-3 parameters under 10,000 elements whole unless told otherwise.
        persistence = 10_000 if target.endswith("TrainOptDeepSpeedStrategy") else 100_000
        return StrategyLayout(
            name=name,
            kind="deepspeed",
            zero_stage=_whole("strategy.stage", node.get("stage", 2)),
            offload_optimizer=off_opt,
            offload_params=off_par,
            reduce_bucket_size=_bucket(node),
            # `auto` (the ZeRO-1/2 presets): the model's parameter count, at most the cap, as the builder runs it.
            buckets_sized_to_model=node.get("reduce_bucket_size") == "auto",
            param_persistence_threshold=_whole(
                "strategy.param_persistence_threshold", node.get("param_persistence_threshold", persistence), 0
            ),
            # Lightning's DeepSpeedStrategy defaults; the stage-3 gather knobs are not Lightning arguments, so
            # DeepSpeed's own defaults apply (runtime/zero/config.py).
            overlap_comm=bool(node.get("overlap_comm", True)),
            contiguous_gradients=bool(node.get("contiguous_gradients", True)),
            # ZeRO-Infinity's host buffers, under Lightning's argument names and defaults.
            sub_group_size=_whole("strategy.sub_group_size", node.get("sub_group_size", 10**12), 0),
            optimizer_buffer_count=_whole("strategy.optimizer_buffer_count", node.get("optimizer_buffer_count", 4)),
            params_buffer_count=_whole("strategy.params_buffer_count", node.get("params_buffer_count", 5)),
            params_buffer_size=_whole("strategy.params_buffer_size", node.get("params_buffer_size", 100_000_000)),
            max_in_cpu=_whole("strategy.max_in_cpu", node.get("max_in_cpu", 1_000_000_000), 0),
        )
    if "fsdp" in name.lower() or "fsdp" in target.lower() or "modelparallel" in target.lower():
        offload = any("offload" in str(k).lower() and v for d in _walk(node) for k, v in d.items())
        return StrategyLayout(
            name=name,
            kind="fsdp",
            offload_params="cpu" if offload else "none",
            offload_optimizer="cpu" if offload else "none",
        )
    if "ddp" in target.lower() or name == "ddp":
        return StrategyLayout(name=name, kind="ddp")
    raise ConfigError("strategy._target_", target, "the planner models ddp, zero1/2/3 (+offload, infinity) and fsdp.")


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
    keys = ("name", "price_per_device_hour", "peak_tflops", "memory_gb", "host_memory_gb")
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

    As ``strategies.builder`` and ``TrainOptDeepSpeedStrategy`` do: a ``train_batch_size`` fixes it to
    ``train_batch_size / (train_micro_batch_size_per_gpu (default data.batch_size) x world)`` when
    ``trainer.accumulate_grad_batches`` is 1, and must agree with it otherwise.

    Raises:
        ConfigError: ``gradient_accumulation_steps`` in the JSON (Lightning refuses it), or a ``train_batch_size``
            that the micro-batch, world size and accumulation cannot make.
    """
    from lightning_trainopt.strategies.deepspeed import TrainOptDeepSpeedStrategy

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
    """Run ``train.py``'s per-key checks (``app.validate.validate_config``) on a config planned for other hardware.

    The checks about this machine (its CUDA device or core count, fp16 on its accelerator) do not apply to a plan
    for hardware it does not have, so they see a non-local accelerator; fp16 on planned CPU hardware is refused by
    :func:`check_compatible` (the pre-flight rule ``train.py`` applies).

    Raises:
        ConfigError: the value ``train.py`` refuses (``data.batch_size=2.5``, ``optimizer.lr=-1``, ...).
    """
    import copy

    from omegaconf import open_dict

    from lightning_trainopt.app.validate import validate_config

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
    strategy: Any, trainer_precision: str, optimizer_target: str | None, on_cuda: bool, callbacks: Any = None
) -> None:
    """Refuse what ``train.py``'s pre-flight refuses (``app.preflight.RULES``), for the planned hardware.

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

    Raises:
        IncompatibleConfigError: the combination ``train.py`` would refuse, with its reason and fix.
    """
    from lightning_trainopt.app.preflight import RULES, PreflightInput

    # Only the callbacks' _target_ strings matter; resolving whole nodes would fail outside a Hydra run on
    # interpolations such as ${hydra:runtime.output_dir} (the notebook, the ladder's report callback).
    nodes = callbacks.values() if isinstance(callbacks, (DictConfig, dict)) else ()
    targets = tuple(str(v.get("_target_", "")) for v in nodes if isinstance(v, (DictConfig, dict)))
    p = PreflightInput(
        strategy=_plain(strategy) or None,
        precision=trainer_precision,
        optimizer_target=optimizer_target,
        accelerator="gpu" if on_cuda else "cpu",
        callback_targets=targets,
    )
    for rule in RULES:
        if not rule.machine_specific and rule.applies(p):
            raise IncompatibleConfigError(rule.keys(p), rule.reason, rule.fix)


def build_plan_inputs(cfg: DictConfig, activations_name: str = "none") -> PlanInputs:
    """The planner's inputs for a composed ``train.py``/``plan.py`` config.

    Raises:
        ConfigError: a value the planner cannot plan (e.g. ``trainer.devices=-1``, a foreign model,
            ``trainer.accumulate_grad_batches=0``).
        IncompatibleConfigError: a combination ``train.py``'s pre-flight refuses (:func:`check_compatible`).
    """
    model = _plain(cfg.model)
    target = str(model.pop("_target_", "lightning_trainopt.models.GPTConfig"))
    if not target.endswith("GPTConfig"):
        raise ConfigError(
            "model._target_",
            target,
            "plan.py plans GPTConfig models; for another nn.Module use measure_activation_bytes.",
        )
    gpt = GPTConfig(**model)
    devices = _devices(cfg.trainer.get("devices", 1))
    nodes = _positive("trainer.num_nodes", cfg.trainer.get("num_nodes", 1), "use a positive whole node count.")
    micro = _positive("data.batch_size", cfg.data.batch_size, "use a positive micro-batch size per device.")
    seq_len = _positive("data.seq_len", cfg.data.seq_len, "use a positive sequence length.")
    layout = strategy_layout(cfg.get("strategy"), devices * nodes)
    optimizer = optimizer_from_cfg(cfg.optimizer)
    trainer_precision = str(cfg.precision.trainer_precision)
    on_cuda = hardware_from_cfg(cfg.get("hardware")).name != "cpu"
    check_compatible(
        cfg.get("strategy"), trainer_precision, str(cfg.optimizer.get("_target_", "")), on_cuda, cfg.get("callbacks")
    )
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches", accumulate, "use a positive integer (1 = no accumulation)."
        )
    if layout.kind == "deepspeed":
        user_json = deepspeed_user_config(cfg.get("strategy"))
        if user_json is not None:
            from lightning_trainopt.strategies.deepspeed_json import check_json_precision

            check_json_precision(user_json, trainer_precision)
            accumulate = json_accumulation(user_json, micro, devices * nodes, accumulate)
    return PlanInputs(
        model=gpt,
        trainer_precision=trainer_precision,
        layout=layout,
        optimizer=optimizer,
        activations=activation_policy(cfg.get("activations"), activations_name),
        micro_batch=micro,
        seq_len=seq_len,
        accumulate=accumulate,
        devices=devices,
        num_nodes=nodes,
        attention=str(cfg.get("plan", {}).get("attention", "sdpa")),
    )


def search_space_from_cfg(space_node: Any, conf_dir: Path, world_size: int) -> SearchSpace:
    """The :class:`SearchSpace` of ``plan.search_space``: every listed preset must exist, every list be non-empty.

    On one device the ``ddp`` preset stands for :data:`NO_STRATEGY` (Lightning's single device, no ``+strategy``):
    the DDP wrapper would only add its gradient buckets.

    Raises:
        ConfigError: a missing or empty list, an unknown preset (the key, the name and the presets that exist), or a
            micro-batch that is not a positive whole number.
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
        if layout.kind == "ddp" and world_size == 1:
            strategies[NO_STRATEGY] = StrategyLayout(name=NO_STRATEGY, kind="single")
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
    return SearchSpace(precisions, strategies, activations, optimizers, micro)
