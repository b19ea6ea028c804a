"""``plan(cfg)``: per-device memory, speed and dollars of a ``train.py`` config, before launch, without the hardware.

``python plan.py <the same overrides as train.py>`` prints the derivation; ``plan.format=json`` prints JSON;
``plan.search=true`` enumerates precision x strategy x activations x optimizer x micro-batch and ranks what fits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.config.plan_adapter import (
    adapter_plan,
    adapter_plans_to_search,
    adapter_refused,
    check_teacher_split,
    teacher_plan,
)
from lightning_trainopt.config.plan_command import override_keys, plan_choices, train_command
from lightning_trainopt.config.plan_inputs import (
    NO_STRATEGY,
    build_plan_inputs,
    check_compatible,
    deepspeed_user_config,
    hardware_from_cfg,
    json_accumulation,
    load_preset,
    search_space_from_cfg,
    strategy_layout,
    validate_like_train,
)
from lightning_trainopt.config.preflight import adapter_kind
from lightning_trainopt.config.tree import CONF_DIR
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.metrics.hardware import compute_dtype_key
from lightning_trainopt.planner import (
    PlanEstimate,
    PlanInputs,
    StrategyLayout,
    estimate_plan,
    least_parallelism,
    search_plans,
    textbook_model_state_bytes,
)
from lightning_trainopt.planner.offload_time import Bandwidths
from lightning_trainopt.planner.report import seq_len_note
from lightning_trainopt.planner.result import DEFAULT_HFU, PlanResult
from lightning_trainopt.planner.search import best_per_configuration, simplicity

__all__ = ["PlanResult", "plan", "plan_task"]

_DEFAULT_CONF = CONF_DIR
# The `plan` node's defaults (conf/plan.yaml), also used when plan(cfg) is called on a config without that node.
_DEFAULTS = {"hfu": DEFAULT_HFU, "target_tokens": 1e9, "headroom_fraction": 0.05, "top_k": 10}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _measured_tokens_per_sec(path: Any, inputs: PlanInputs, on_cuda: bool) -> float | None:
    """Per-device tokens/s of a short ``train.py`` run of the same configuration (``plan.metrics``).

    Raises:
        ConfigError: the file is missing, has no speed, or comes from a run of another model, sequence length,
            precision or device type (its speed would not apply).
    """
    if not path:
        return None
    file = Path(str(path))
    if not file.is_file():
        raise ConfigError(
            "plan.metrics", str(path), "give the metrics.json of a short train.py run (it does not exist)."
        )
    data = json.loads(file.read_text())
    expected = {
        "n_params": inputs.profile.n_params,
        "seq_len": inputs.seq_len,
        "trainer_precision": inputs.trainer_precision,
        "accelerator": "cuda" if on_cuda else "cpu",
    }
    recorded = {k: data.get(k) for k in expected}
    if recorded["accelerator"] == "gpu":
        recorded["accelerator"] = "cuda"
    wrong = [f"{k} {recorded[k]!r} (planned {v!r})" for k, v in expected.items() if recorded[k] != v]
    if wrong:
        raise ConfigError(
            "plan.metrics",
            str(path),
            "its run does not match the planned config: " + "; ".join(wrong) + ". Give the metrics.json of a "
            "train.py run of the same model, seq_len, precision and device type, or drop plan.metrics.",
        )
    world = int(data.get("world_size") or inputs.world_size)
    if data.get("tokens_per_sec_per_device"):
        return float(data["tokens_per_sec_per_device"])
    if data.get("tokens_per_sec"):
        return float(data["tokens_per_sec"]) / world
    raise ConfigError("plan.metrics", str(path), "that metrics.json has no tokens_per_sec; run train.py longer.")


def _seq_len_default_of(cfg: DictConfig) -> str:
    """The data preset whose default ``seq_len`` the config plans, or ``""`` when ``data.seq_len`` was set.

    Set means given as an override, or (for a config built in Python) different from the preset's own value. The
    preset is Hydra's choice of the ``data`` group, else ``plan.choices.data``, else the data node's ``corpus``.
    """
    if "data.seq_len" in override_keys(cfg):
        return ""
    try:
        from hydra.core.hydra_config import HydraConfig

        runtime = HydraConfig.get().runtime.choices.get("data")
    except ValueError:
        runtime = None
    given = (_plain((cfg.get("plan") or {}).get("choices")) or {}).get("data")
    name = str(given or runtime or cfg.data.get("corpus") or "")
    conf = _conf_dir(cfg)
    if not name or not (conf / "data" / f"{name}.yaml").is_file():
        return ""
    return name if load_preset(conf, "data", name).get("seq_len") == cfg.data.seq_len else ""


def _conf_dir(cfg: DictConfig) -> Path:
    given = (cfg.get("plan") or {}).get("conf_dir")
    return Path(str(given)) if given else _DEFAULT_CONF


def _adam_path(cfg: DictConfig, on_cuda: bool) -> Callable[[PlanInputs], str]:
    """``inputs -> adam_path``: how torch Adam/AdamW runs its step in ``train.py`` (see ``model_states.ADAM_PATHS``).

    On CUDA, LitGPT gives a torch Adam/AdamW partial the fused kernel (no temporary) unless it sets ``fused`` or
    ``foreach``, the strategy is DeepSpeed (which steps the client optimizer on its flat fp32 partitions: torch's
    default there is ``foreach``), or fp16 AMP with gradient clipping (``optim.optimizers.fused_adam_kwargs``).
    On CPU torch has no foreach kernels: the single-tensor loop, unless the node asks for ``fused``/``foreach``.
    """
    opt = cfg.get("optimizer") or {}
    fused, foreach = opt.get("fused"), opt.get("foreach")
    clip = bool((cfg.get("trainer") or {}).get("gradient_clip_val"))

    def path(inputs: PlanInputs) -> str:
        if fused is True:
            return "fused"
        if foreach is not None:
            return "foreach" if foreach else "single_tensor"
        if not on_cuda:
            return "single_tensor"
        if fused is False or inputs.layout.flat_partitions:
            return "foreach"  # torch's CUDA default when the fused kernel is not asked for
        return "foreach" if inputs.trainer_precision == "16-mixed" and clip else "fused"

    return path


def _allowed(cfg: DictConfig, on_cuda: bool) -> Callable[[dict[str, str], PlanInputs], bool]:
    """``(choices, inputs) -> bool`` for the search: does ``train.py``'s pre-flight accept the candidate?"""

    conf = _conf_dir(cfg)
    base_precision = plan_choices(cfg).get("precision")

    def allowed(choices: dict[str, str], inputs: PlanInputs) -> bool:
        kind = inputs.adapter.kind if inputs.adapter else None
        if adapter_refused(kind, inputs.layout, inputs.tensor_parallel, inputs.data_parallel_size):
            return False
        name = choices.get("strategy")
        strategy = load_preset(conf, "strategy", name) if name and name != NO_STRATEGY else None
        # Without a preset name (the Python API with partial plan.choices): the composed config's own optimizer.
        optimizer = choices.get("optimizer")
        node = load_preset(conf, "optimizer", optimizer) if optimizer else (cfg.get("optimizer") or {})
        target = str(node.get("_target_", ""))
        try:
            # The config's own precision node (with its overrides) unless the candidate swaps in another preset.
            name = choices.get("precision")
            swapped = name is not None and name != base_precision and (conf / "precision" / f"{name}.yaml").is_file()
            precision = load_preset(conf, "precision", name) if swapped and name else cfg.get("precision")
            adapter = adapter_kind(cfg)
            check_compatible(
                strategy, inputs.trainer_precision, target, on_cuda, cfg.get("callbacks"), precision, adapter
            )
        except IncompatibleConfigError:
            return False
        return True

    return allowed


def _plan_number(plan_cfg: Any, key: str) -> float:
    """A numeric ``plan.<key>`` (default from ``conf/plan.yaml``); the range is checked where it is used."""
    value = plan_cfg.get(key, _DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"plan.{key}", value, f"use a number, e.g. plan.{key}={_DEFAULTS[key]}.")
    return float(value)


def _next_step(
    cfg: DictConfig,
    choices: dict[str, str],
    inputs: PlanInputs,
    run: Callable[[PlanInputs], PlanEstimate],
    adam_path: Callable[[PlanInputs], str],
    allowed: Callable[[dict[str, str], PlanInputs], bool],
) -> str:
    """What to run instead of a configuration that does not fit.

    The fewest devices (1, 2, 4, 8 x the planned count: devices per node; nodes when there are several or when the
    host RAM is what does not fit) and then
    the simplest strategy (the planned one first, then ``plan.search_space.strategy``) at which the same precision,
    activations, optimizer and micro-batch fit, as a ``train.py`` command; else what else to change.
    """
    space = search_space_from_cfg((cfg.get("plan") or {}).get("search_space"), _conf_dir(cfg), inputs.world_size)
    current = choices.get("strategy")
    user_json = deepspeed_user_config(cfg.get("strategy"))
    # More devices in one node leave the node's offloaded bytes as they are (each rank's share shrinks as the ranks
    # grow): when the host RAM is what does not fit, or there are already several nodes, grow the nodes instead.
    grow_nodes = inputs.num_nodes > 1 or run(inputs).host_fits is False
    for factor in (1, 2, 4, 8):
        devices = inputs.devices * (1 if grow_nodes else factor)
        nodes = inputs.num_nodes * (factor if grow_nodes else 1)
        world = devices * nodes
        options: list[tuple[str | None, StrategyLayout]] = []
        if factor > 1:
            options.append((current, strategy_layout(cfg.get("strategy"), world)))
        for preset in sorted(space.strategies, key=simplicity):
            if preset != current and not (preset == NO_STRATEGY and world > 1):
                node = None if preset == NO_STRATEGY else load_preset(_conf_dir(cfg), "strategy", preset)
                options.append((preset, strategy_layout(node, world)))
        for name, layout in options:
            accumulate = inputs.accumulate
            if name == current and user_json is not None:
                try:  # a JSON train_batch_size fixes the global batch: the accumulation follows the world size
                    accumulate = json_accumulation(user_json, inputs.micro_batch, world, 1)
                except ConfigError:
                    continue
            try:
                i = replace(inputs, layout=layout, devices=devices, num_nodes=nodes, accumulate=accumulate)
            except IncompatibleConfigError:
                continue  # e.g. a ZeRO preset with the planned tensor parallelism
            i = replace(i, adam_path=adam_path(i))
            picked = {**choices, "strategy": name} if name else dict(choices)
            if name != current and not allowed(picked, i):
                continue
            e = run(i)
            if e.fits:
                swapped = {"strategy": name} if name != current and name else {}
                where = f"{world} device{'s' if world > 1 else ''}" + (f" ({nodes} nodes)" if nodes > 1 else "")
                how = "the same strategy" if name == current else f"strategy {name}"
                return (
                    f"with {how} on {where} the peak is {e.peak_device_bytes / 2**30:,.2f} GiB and fits: "
                    f"{train_command(cfg, picked, i, swapped)}  (or add plan.search=true to rank every configuration)"
                )
    return (
        f"no strategy in plan.search_space.strategy fits with this micro-batch on up to {8 * inputs.world_size} "
        "devices: add plan.search=true (activation checkpointing, 8-bit states, smaller micro-batches), or lower "
        "data.seq_len or the model size."
    )


def plan(cfg: DictConfig) -> PlanResult:
    """Estimate a composed ``plan.py`` / ``train.py`` config (no Trainer, no device, no memory allocated).

    Args:
        cfg: the composed config (``conf/plan.yaml``: the groups of ``train.py`` plus a ``plan`` node; without one,
            the defaults of ``conf/plan.yaml`` apply).

    Raises:
        ConfigError: a value the planner cannot plan or ``train.py`` refuses, named with its key and the fix.
        IncompatibleConfigError: a combination ``train.py``'s pre-flight refuses.
    """
    plan_cfg = cfg.get("plan") or OmegaConf.create({})
    top_k = _check_top_k(plan_cfg.get("top_k", _DEFAULTS["top_k"]))
    _refuse_mfu(plan_cfg.get("mfu"))
    hfu, target = _plan_number(plan_cfg, "hfu"), _plan_number(plan_cfg, "target_tokens")
    headroom = _plan_number(plan_cfg, "headroom_fraction")
    search = plan_cfg.get("search", False)
    if not isinstance(search, bool):
        raise ConfigError("plan.search", search, "use true or false.")
    from lightning_trainopt.config.data_vocab import apply_hf_synthetic_vocab, apply_manifest_vocab

    apply_manifest_vocab(cfg)
    apply_hf_synthetic_vocab(cfg)
    validate_like_train(cfg)
    hardware = hardware_from_cfg(cfg.get("hardware"))
    on_cuda = hardware.name != "cpu"
    choices = plan_choices(cfg)
    adam_path = _adam_path(cfg, on_cuda)
    base = build_plan_inputs(cfg, choices.get("activations", "none"))
    base = replace(base, adapter=adapter_plan(cfg, base.model), teacher=teacher_plan(cfg, _conf_dir(cfg), base.seq_len))
    check_teacher_split(cfg, base.tensor_parallel)  # the teacher train.py refuses under TP
    inputs = replace(base, adam_path=adam_path(base))
    measured = _measured_tokens_per_sec(plan_cfg.get("metrics"), inputs, on_cuda)
    bandwidths = Bandwidths(
        hardware.pcie_bytes_per_s,
        hardware.memory_bytes_per_s,
        hardware.nvme_bytes_per_s,
        hardware.cpu_adam_params_per_s,
        hardware.nvlink_bytes_per_s,
        hardware.network_bytes_per_s,
    )

    def run(i: PlanInputs) -> PlanEstimate:
        # A measured speed belongs to the configuration that ran; every other candidate keeps the FLOPs model.
        peak = hardware.peak(compute_dtype_key(i.trainer_precision, on_cuda))
        # Converted layers run at the FP8 peak where there are real FP8 GEMMs (not on a CPU, which emulates them).
        fp8_peak = hardware.peak("fp8") if i.precision is not None and i.precision.fp8 and on_cuda else None
        tps = measured if i == inputs else None
        return estimate_plan(
            i,
            hardware.memory_bytes,
            peak,
            hardware.price_per_device_hour,
            hfu,
            target,
            tps,
            headroom,
            hardware.host_memory_bytes,
            device_is_host=not on_cuda,
            bandwidths=bandwidths,
            fp8_peak_flops=fp8_peak,
        )

    est = run(inputs)
    default_of = _seq_len_default_of(cfg)
    note = seq_len_note(inputs, default_of)
    n = inputs.profile.n_params
    textbook = {s: textbook_model_state_bytes(n, s) for s in ("fp32", "mixed")}
    allowed = _allowed(cfg, on_cuda)
    if not search:
        nxt = _next_step(cfg, choices, inputs, run, adam_path, allowed) if est.fits is False else ""
        cmd = train_command(cfg, choices, inputs)
        return PlanResult(
            est,
            hardware,
            choices,
            cmd,
            textbook=textbook,
            top_k=top_k,
            next_step=nxt,
            hfu=hfu,
            seq_len_default_of=default_of,
            seq_len_note=note,
        )
    space_node = plan_cfg.get("search_space")
    known = {choices["precision"]: inputs.precision} if "precision" in choices else {}
    space = search_space_from_cfg(space_node, _conf_dir(cfg), inputs.world_size, cfg, on_cuda, known)
    space = replace(space, adapters=adapter_plans_to_search(cfg, inputs.model))
    every, n_enum = search_plans(inputs, space, run, adam_path, allowed)
    ranked = best_per_configuration(every)
    max_tp = max((t for t in space.tensor_parallel if t <= inputs.devices), default=1)
    needs = least_parallelism(ranked, max_tp).message if n_enum else ""
    if not n_enum:
        raise ConfigError(
            "plan.search_space",
            _plain(space_node),
            "train.py's pre-flight refuses every combination of it on this hardware (e.g. 8-bit states with offload "
            "or FSDP only, fp16 on CPU); add presets it accepts.",
        )
    cmd = ""
    if ranked:
        win = ranked[0]
        swapped = {g: p for g, p in win.choices.items() if choices.get(g) != p}
        cmd = train_command(cfg, {**choices, **win.choices}, win.estimate.inputs, swapped)
    return PlanResult(
        est,
        hardware,
        choices,
        cmd,
        ranked,
        n_enum,
        textbook,
        top_k=top_k,
        hfu=hfu,
        seq_len_default_of=default_of,
        seq_len_note=note,
        parallelism=needs,
    )


def _refuse_mfu(value: Any) -> None:
    """``plan.mfu`` was renamed ``plan.hfu``: the fraction was always applied to the FLOPs executed.

    Raises:
        ConfigError: ``plan.mfu`` is set.
    """
    if value is not None:
        raise ConfigError(
            "plan.mfu",
            value,
            f"it is now plan.hfu: the fraction of the peak applies to the FLOPs executed, recomputation included (a "
            f"hardware FLOPs utilisation); use plan.hfu={value}. The model FLOPs utilisation a plan implies is "
            "printed beside it (JSON mfu).",
        )


def _check_top_k(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("plan.top_k", value, "use a positive number of rows, e.g. plan.top_k=10.")
    return value


def plan_task(cfg: DictConfig) -> PlanResult:
    """The ``@hydra.main`` task of ``plan.py``: plan and print (rich screen or JSON)."""
    from lightning_trainopt.planner.report import print_plan

    fmt = str((cfg.get("plan") or {}).get("format", "rich"))
    if fmt not in ("rich", "json"):
        raise ConfigError("plan.format", fmt, "use rich or json.")
    result = plan(cfg)
    if fmt == "json":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print_plan(result)
    return result
