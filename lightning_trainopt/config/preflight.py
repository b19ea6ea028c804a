"""Pre-flight checks: refuse known-bad strategy combinations and missing optional packages before any process spawns.

The same rules render the documentation table (:func:`compatibility_matrix_markdown`), so docs and code agree.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning_trainopt.config.strategy import strategy_spec
from lightning_trainopt.config.tp_preflight import check_tensor_parallel, tensor_parallel_size
from lightning_trainopt.config.tree import CONF_DIR
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError, MissingDependencyError
from lightning_trainopt.parallel.spec import StrategySpec
from lightning_trainopt.precision.plugins import FP16_FSDP2_FIX, FP16_FSDP2_REASON

__all__ = [
    "FP8_MIN_CAPABILITY",
    "PreflightInput",
    "RULES",
    "Requirement",
    "Rule",
    "check_packages",
    "check_vocab",
    "compatibility_matrix_markdown",
    "estimate_nvme_bytes",
    "optimizer_preset",
    "package_importable",
    "preflight",
    "preflight_from_cfg",
    "required_packages",
    "size_advice",
]

# No +strategy: Lightning picks (single device, or DDP on more).
_NO_STRATEGY = StrategySpec(name="auto", kind="none")
_ADAM_TARGETS = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.adamw.AdamW", "torch.optim.adam.Adam")
_OPTIMIZER_CONF = CONF_DIR / "optimizer"


@functools.cache
def _optimizer_presets() -> dict[str, str]:
    """``{_target_: preset name}`` of ``conf/optimizer/*.yaml``."""
    from omegaconf import DictConfig, OmegaConf

    presets: dict[str, str] = {}
    for path in sorted(_OPTIMIZER_CONF.glob("*.yaml")):
        node = OmegaConf.load(path)
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        if target:
            presets.setdefault(str(target), path.stem)
    return presets


def optimizer_preset(target: str | None) -> str | None:
    """The ``conf/optimizer`` preset a user selects for ``target`` (``optimizer=adamw8bit``), else ``target`` itself.

    Refusals name what the user typed, not the factory behind it
    (``lightning_trainopt.optim.optimizers.bnb_adamw8bit``).
    """
    if target is None:
        return None
    return _optimizer_presets().get(target, target)


@dataclass(frozen=True)
class PreflightInput:
    """What the checks look at, extracted from the composed config.

    The strategy is its :class:`~lightning_trainopt.parallel.spec.StrategySpec` (read once from the node by
    :func:`~lightning_trainopt.config.strategy.strategy_spec`); the rules ask it questions
    (``p.strategy.offloads_optimizer``) rather than testing its kind.

    Args:
        strategy: what the ``strategy`` node means; the default is no ``+strategy`` (Lightning picks).
        precision: the Trainer precision string (``32-true``, ``bf16-mixed``, ``16-mixed``, ``transformer-engine``...)
            or ``fp8`` for torchao float8 training.
        optimizer_target: the optimizer's ``_target_`` (``torch.optim.AdamW``, ``bitsandbytes.optim.AdamW8bit``...).
        accelerator: ``cpu``, ``gpu``/``cuda`` or ``auto`` (resolved against ``torch.cuda.is_available()``).
        callback_targets: ``_target_`` of each configured callback.
        non_finite_skip: a configured ``NonFiniteGuard`` skips non-finite steps (``policy=skip``, its default).
        n_params: model parameter count (for advice and the NVMe size estimate), if known.
        world_size: processes in the job (for the NVMe size estimate).
        precision_preset: the precision preset's name (``bf16``), for messages.
        logger_targets: ``(name, _target_)`` of each configured logger.
        fp8_backend: ``torchao`` (``precision=fp8``) or ``transformer_engine`` (``fp8_te``); ``None`` without FP8.
        fp8_emulate: ``precision.emulate`` (``None``: emulate on CPU only).
        transforms_model: the preset changes the model before the strategy wraps it (FP8, ``keep_fp32``).
        tensor_parallel: the tensor-parallel size (``ParallelDims.tp``): under ``TrainOptTPStrategy`` the rewrite
            table's ``tp`` (no data parallelism) or ``fsdp_tp`` column.
        techniques: the model rewrites the config turns on, as rows of
            :data:`~lightning_trainopt.parallel.compat_table.TABLE` (``fp8``, ``checkpoint``, ``compile``...);
            default: ``fp8``/``keep_fp32`` from the precision fields above.
        adapter: ``adapter.kind`` (``none``, ``lora``, ``qlora``): the adapter dimension of the table
            (:data:`~lightning_trainopt.parallel.compat_table.ADAPTER_TABLE`).
    """

    strategy: StrategySpec = _NO_STRATEGY
    precision: str = "32-true"
    optimizer_target: str | None = None
    accelerator: str = "auto"
    callback_targets: tuple[str, ...] = ()
    non_finite_skip: bool = False
    n_params: int | None = None
    world_size: int = 1
    precision_preset: str | None = None
    logger_targets: tuple[tuple[str, str], ...] = ()
    fp8_backend: str | None = None
    fp8_emulate: bool | None = None
    transforms_model: bool = False
    techniques: tuple[str, ...] | None = None
    tensor_parallel: int = 1
    adapter: str = "none"

    def rewrites(self) -> tuple[str, ...]:
        """The table rows that apply: :attr:`techniques`, else what the precision fields imply."""
        if self.techniques is not None:
            return self.techniques
        if self.fp8_backend is not None:
            return ("fp8",)
        return ("keep_fp32",) if self.transforms_model else ()

    @property
    def optimizer(self) -> str | None:
        """The optimizer preset as the user selects it (``adamw8bit``), or its ``_target_`` when no preset has it."""
        return optimizer_preset(self.optimizer_target)

    @property
    def preset(self) -> str:
        """The strategy as metrics.json and messages name it (``zero3``; ``auto`` without one)."""
        return self.strategy.name

    def on_cpu(self) -> bool:
        if self.accelerator == "cpu":
            return True
        if self.accelerator in ("gpu", "cuda"):
            return False
        import torch

        return not torch.cuda.is_available()

    def gpu(self) -> tuple[str, tuple[int, int]] | None:
        """The first visible CUDA device's name and compute capability, ``None`` on CPU."""
        if self.on_cpu():
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(0)
        return torch.cuda.get_device_name(0), (int(major), int(minor))

    def real_fp8_gemms(self) -> bool:
        """FP8 GEMMs run on the GPU's tensor cores (not torchao's fp32 emulation)."""
        return self.fp8_backend is not None and not self.on_cpu() and not self.fp8_emulate


@dataclass(frozen=True)
class Rule:
    """One refused combination: when it applies, why it breaks, and what to use instead."""

    combination: str
    reason: str
    fix: str
    applies: Callable[[PreflightInput], bool] = field(compare=False)
    keys: Callable[[PreflightInput], dict[str, Any]] = field(compare=False)
    #: about the machine running the check (e.g. its libaio), not the configuration: the planner skips it.
    machine_specific: bool = False


def _is_8bit(target: str | None) -> bool:
    if not target:
        return False
    return "bitsandbytes" in target or "8bit" in target.lower() or "torchao" in target


def _lightning_te(p: PreflightInput) -> bool:
    return p.precision.startswith("transformer-engine")


#: FP8 tensor cores: Ada (8.9: L4, L40S), Hopper (9.0: H100, H200), Blackwell (10.0: B200).
FP8_MIN_CAPABILITY = (8, 9)


def _gpu_below_fp8(p: PreflightInput) -> bool:
    found = p.gpu() if p.real_fp8_gemms() else None
    return found is not None and found[1] < FP8_MIN_CAPABILITY


def _gpu_keys(p: PreflightInput) -> dict[str, Any]:
    found = p.gpu()
    gpu = "none" if found is None else f"{found[0]} (compute capability {found[1][0]}.{found[1][1]})"
    return {"precision": p.precision_preset, "gpu": gpu}


def _ds_optimizer_block(p: PreflightInput) -> bool:
    return p.strategy.json_optimizer


RULES: tuple[Rule, ...] = (
    Rule(
        "Lightning's transformer-engine precision + DeepSpeed or FSDP",
        "Lightning runs one precision plugin per strategy: DeepSpeedPrecision and FSDP/ModelParallel precision "
        "reject transformer-engine FP8 (Lightning #18820, #18679).",
        "use precision=fp8 (torchao) or precision=fp8_te (Transformer Engine): they convert the model before the "
        "DeepSpeed engine or fully_shard wraps it.",
        lambda p: _lightning_te(p) and p.strategy.own_precision_plugin,
        lambda p: {"precision": p.precision, "strategy": p.preset},
    ),
    Rule(
        "fp8_te on CPU",
        "Transformer Engine runs only on NVIDIA GPUs: its FP8 kernels are CUDA, and it cannot be installed without "
        "CUDA.",
        "use precision=fp8 (torchao), which emulates the FP8 GEMMs in fp32 on CPU.",
        lambda p: p.fp8_backend == "transformer_engine" and p.on_cpu(),
        lambda p: {"precision": p.precision_preset, "trainer.accelerator": "cpu"},
    ),
    Rule(
        "FP8 on a GPU below compute capability 8.9",
        "FP8 GEMMs need FP8 tensor cores, which exist from compute capability 8.9 (L4, L40S, H100, H200, B200); "
        "torch._scaled_mm and Transformer Engine refuse older GPUs.",
        "use precision=bf16 on this GPU (or precision=fp8 precision.emulate=true to check FP8 numerics, slowly).",
        _gpu_below_fp8,
        _gpu_keys,
        machine_specific=True,
    ),
    Rule(
        "8-bit optimizer + offload",
        "offload steps the optimizer on the CPU with DeepSpeed's CPU Adam (or FSDP's CPU copy); 8-bit optimizer "
        "states cannot be offloaded (DeepSpeed #6666) and DeepSpeed refuses a client optimizer under offload.",
        "drop the offload (zero1/zero2 keep 8-bit states) or use optimizer=adamw with the offload preset.",
        lambda p: _is_8bit(p.optimizer_target) and p.strategy.offloads_optimizer,
        lambda p: {"optimizer": p.optimizer, "strategy": p.preset},
    ),
    Rule(
        "8-bit optimizer + FSDP",
        "FSDP2 parameters are DTensors and bitsandbytes' fused 8-bit update mixes them with plain tensors: "
        "'optimizer_update_8bit_blockwise got mixed torch.Tensor and DTensor' (measured; bitsandbytes #89 reports "
        "the same class of failure for FSDP1).",
        "use the 8-bit optimizer with zero1/zero2/zero3 (DeepSpeed hands it flat local partitions) or adamw with fsdp.",
        lambda p: _is_8bit(p.optimizer_target) and p.strategy.shards_each_param,
        lambda p: {"optimizer": p.optimizer, "strategy": p.preset},
    ),
    Rule(
        "non-Adam optimizer + offload",
        "ZeRO-Offload needs DeepSpeed's CPU optimizer; only torch Adam/AdamW have a drop-in CPU Adam, any other "
        "client optimizer makes DeepSpeed raise ZeRORuntimeException.",
        "use optimizer=adamw (replaced by DeepSpeedCPUAdam automatically) or a preset without offload.",
        lambda p: (
            p.strategy.steps_cpu_adam
            and not _ds_optimizer_block(p)
            and not _is_8bit(p.optimizer_target)
            and p.optimizer_target is not None
            and p.optimizer_target not in _ADAM_TARGETS
        ),
        lambda p: {"optimizer": p.optimizer, "strategy": p.preset},
    ),
    Rule(
        "NonFiniteGuard policy=skip + DeepSpeed",
        "DeepSpeed keeps gradients in its own partitions, so the guard cannot drop them to skip a step.",
        "use callbacks.non_finite_guard.policy=stop (DeepSpeed's fp16 loss scaler skips overflows itself).",
        lambda p: p.strategy.wraps_in_engine and p.non_finite_skip,
        lambda p: {"callbacks.non_finite_guard.policy": "skip", "strategy": p.preset},
    ),
    Rule(
        "GradientAccumulationScheduler + DeepSpeed",
        "DeepSpeed fixes gradient_accumulation_steps in its config at start-up; Lightning raises when the scheduler "
        "changes accumulation between epochs.",
        "use a constant trainer.accumulate_grad_batches, or ddp/fsdp with the scheduler.",
        lambda p: (
            p.strategy.wraps_in_engine and any(t.endswith("GradientAccumulationScheduler") for t in p.callback_targets)
        ),
        lambda p: {"callbacks": "GradientAccumulationScheduler", "strategy": p.preset},
    ),
    Rule(
        "fp16 AMP + FSDP2",
        FP16_FSDP2_REASON,
        FP16_FSDP2_FIX,
        lambda p: p.precision == "16-mixed" and p.strategy.fsdp_version == 2,
        lambda p: {"precision": p.precision, "strategy": p.preset},
    ),
    Rule(
        "fp16 on CPU",
        "CPUs have no fp16 autocast: Lightning silently switches 16-mixed to bf16, DeepSpeed raises 'Type fp16 is "
        "not supported on your device', and 16-true diverges to NaN.",
        "use precision=bf16 (or bf16_true / fp32) on CPU.",
        lambda p: p.precision.startswith("16") and p.on_cpu(),
        lambda p: {"precision": p.precision, "trainer.accelerator": "cpu"},
    ),
    Rule(
        "NVMe offload without async I/O",
        "ZeRO-Infinity swaps through DeepSpeed's async_io op, which needs the system library libaio.",
        "install it (apt-get install -y libaio-dev) or use zero3_offload (CPU).",
        lambda p: p.strategy.offloads_to_nvme and not _async_io_ok(),
        lambda p: {"strategy": p.preset, "async_io": "unavailable"},
        machine_specific=True,
    ),
    Rule(
        "FSDP1 on CPU",
        "torch's FullyShardedDataParallel (Lightning FSDPStrategy) raises 'FSDP needs a non-CPU accelerator device'.",
        "use +strategy=fsdp (FSDP2 fully_shard through ModelParallelStrategy), which runs on CPU.",
        lambda p: p.strategy.fsdp_version == 1 and p.on_cpu(),
        lambda p: {"strategy": p.preset, "trainer.accelerator": "cpu"},
    ),
)


def _async_io_ok() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return False
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


@dataclass(frozen=True)
class Requirement:
    """An optional package that a chosen preset needs.

    Args:
        feature: what needs it, as the user selects it (``optimizer=adamw8bit_torchao``).
        package: its import name (``torchao``).
        extra: the pip extra of lightning_trainopt that installs it.
        alternatives: other import names that serve as well (Lightning's TensorBoardLogger also takes tensorboardX).
    """

    feature: str
    package: str
    extra: str
    alternatives: tuple[str, ...] = ()


def required_packages(p: PreflightInput) -> list[Requirement]:
    """The optional packages the configuration needs, each with the preset that needs it and the pip extra.

    Only what the fit needs counts: a monitor that switches itself off without its package (``GPUMonitor`` without
    nvidia-ml-py) needs nothing, nor does the ladder report, which writes its table without matplotlib's plot.
    """
    needs: list[Requirement] = []
    target = p.optimizer_target or ""
    if "bitsandbytes" in target or target.rsplit(".", 1)[-1].startswith("bnb_"):
        needs.append(Requirement(f"optimizer={p.optimizer}", "bitsandbytes", "bnb"))
    elif "torchao" in target:
        needs.append(Requirement(f"optimizer={p.optimizer}", "torchao", "torchao"))
    if p.strategy.package is not None:
        needs.append(Requirement(f"+strategy={p.preset}", p.strategy.package, p.strategy.package))
    # fp8_te on a CPU is refused by a rule instead: installing Transformer Engine would not help there.
    te = p.fp8_backend == "transformer_engine" and not p.on_cpu()
    if p.precision.startswith("transformer-engine") or te:
        needs.append(Requirement(f"precision={p.precision_preset or p.precision}", "transformer_engine", "gpu"))
    if p.fp8_backend == "torchao":
        needs.append(Requirement(f"precision={p.precision_preset}", "torchao", "torchao"))
    for name, logger in p.logger_targets:
        if logger.endswith("TensorBoardLogger"):
            needs.append(Requirement(f"logger={name}", "tensorboard", "tensorboard", alternatives=("tensorboardX",)))
    return needs


def package_importable(name: str) -> bool:
    """``name`` imports here: installed and not broken (a broken install would fail the job later, after spawning)."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def check_packages(requirements: Iterable[Requirement], importable: Callable[[str], bool] = package_importable) -> None:
    """Refuse the first requirement none of whose packages imports.

    Raises:
        MissingDependencyError: naming the preset, the package and the ``pip install`` command (with the torch pin).
    """
    for req in requirements:
        if not any(importable(name) for name in (req.package, *req.alternatives)):
            raise MissingDependencyError(req.package, req.extra, req.feature)


def estimate_nvme_bytes(n_params: int, world_size: int, offload: dict[str, str]) -> int:
    """Swap bytes on one node: fp32 master + 2 Adam moments (12 B/param) and half weights (2 B/param)."""
    per_param = (12 if offload.get("optimizer") == "nvme" else 0) + (2 if offload.get("param") == "nvme" else 0)
    return n_params * per_param  # the shards of all ranks on one node add up to the whole model


def _check_nvme(p: PreflightInput) -> None:
    """Each NVMe swap folder exists, is writable and has room for what goes there (keys as the user wrote them)."""
    need: dict[str, tuple[str, int]] = {}
    for what, key, path in p.strategy.nvme_swaps():
        if not path or not os.path.isdir(path):
            raise ConfigError(key, path, "point it at an existing directory on a local NVMe drive.")
        if not os.access(path, os.W_OK):
            raise ConfigError(key, path, "the directory is not writable by this user; choose another.")
        if p.n_params:
            first_key, nbytes = need.get(path, (key, 0))
            need[path] = first_key, nbytes + estimate_nvme_bytes(p.n_params, p.world_size, {what: "nvme"})
    for path, (key, nbytes) in need.items():
        free = shutil.disk_usage(path).free
        if free < nbytes:
            raise ConfigError(
                key,
                path,
                f"{free / 2**30:.1f} GiB free but the swap needs about {nbytes / 2**30:.1f} GiB "
                f"({p.n_params:,} params); free space or pick a larger drive.",
            )


def size_advice(n_params: int, strategy: StrategySpec) -> str | None:
    """Rule-of-thumb advice (never enforced): <1B DDP; 1-10B DP + ZeRO-2; 10-100B ZeRO-3 + TP; >100B PP + TP + DP.

    Far from the rule: below 1B, sharding parameters or offloading anything; 1-10B, NVMe offload; 10-100B, gradients
    kept whole on every rank (DDP, ZeRO-1); above 100B, parameters kept whole on every rank (DDP, ZeRO-1, ZeRO-2).
    """
    preset = strategy.name
    billions = n_params / 1e9
    if billions < 1:
        suggested = "ddp"
        far = strategy.shards_params or strategy.offloads_optimizer or strategy.offloads_params
    elif billions < 10:
        suggested = "zero2"
        far = strategy.offloads_to_nvme
    elif billions < 100:
        suggested = "zero3 (with tensor parallelism)"
        far = not strategy.shards_grads
    else:
        suggested = "pipeline + tensor + data parallelism"
        far = not strategy.shards_params
    if not far:
        return None
    return (
        f"Advice: a {billions:.2g}B-parameter model usually trains best with {suggested}; {preset!r} "
        f"{'adds sharding/offload traffic it does not need' if billions < 10 else 'may not fit'}. "
        "(Rule of thumb only; nothing was changed.)"
    )


def check_vocab(model_vocab: int | None, data_vocab: int | None, model_key: str) -> None:
    """Refuse a model whose vocabulary is smaller than the token ids the data holds (the embedding would index out of
    range on the first batch, on CPU an IndexError, on CUDA a device-side assert).

    Args:
        model_vocab: token ids the model embeds, ``None`` when unknown (nothing is checked).
        data_vocab: token ids the data produces (byte-level text: 256), ``None`` when unknown.
        model_key: the config key that sets the model's vocabulary, for the message.

    Raises:
        ConfigError: ``model_vocab < data_vocab``.
    """
    if model_vocab is None or data_vocab is None or model_vocab >= data_vocab:
        return
    raise ConfigError(
        model_key,
        model_vocab,
        f"the data holds token ids up to {data_vocab - 1} ({data_vocab} ids) but the model embeds {model_vocab}; "
        f"give the model at least {data_vocab} (e.g. {model_key}={data_vocab}) or use data with its tokenizer.",
    )


def preflight(p: PreflightInput | Any) -> list[str]:
    """Refuse known-bad combinations; return advice lines (possibly empty).

    Args:
        p: a :class:`PreflightInput`, or the composed Hydra config (see :func:`preflight_from_cfg`).

    Raises:
        IncompatibleConfigError: a combination listed in :data:`RULES`.
        ConfigError: an NVMe path that is missing, read-only or too small.
    """
    if not isinstance(p, PreflightInput):
        return preflight_from_cfg(p)
    for rule in RULES:
        if rule.applies(p):
            raise IncompatibleConfigError(rule.keys(p), rule.reason, rule.fix)
    check_rewrite_table(p)
    _check_nvme(p)
    advice = size_advice(p.n_params, p.strategy) if p.n_params and p.strategy.chosen else None
    return [advice] if advice else []


def check_rewrite_table(p: PreflightInput) -> None:
    """Refuse a technique x strategy pair that :data:`~lightning_trainopt.parallel.compat_table.TABLE` refuses.

    Raises:
        IncompatibleConfigError: the first refused pair, naming the technique's key and the strategy.
    """
    from lightning_trainopt.parallel.compat_table import TECHNIQUE_KEYS, TECHNIQUES, cell

    tp = p.tensor_parallel
    family = p.strategy.family_at(tp, p.world_size // tp)
    if family is None:
        return
    for technique in TECHNIQUES:
        refusal = cell(technique, family) if technique in p.rewrites() else None
        if refusal is not None:
            key = TECHNIQUE_KEYS[technique]
            value = p.precision_preset if key == "precision" else technique
            raise IncompatibleConfigError({key: value, "strategy": p.preset}, refusal.reason, refusal.fix)
    check_adapter_table(p.adapter, family, p.preset)


def check_adapter_table(adapter: str, family: str | None, preset: str) -> None:
    """Refuse an adapter x strategy pair that :data:`~lightning_trainopt.parallel.compat_table.ADAPTER_TABLE`
    refuses (``train.py``'s pre-flight and ``plan.py`` both call it).

    Raises:
        IncompatibleConfigError: naming ``adapter`` and ``strategy``, with the reason and what to use instead.
    """
    from lightning_trainopt.parallel.compat_table import adapter_cell

    refusal = adapter_cell(adapter, family) if family is not None else None  # type: ignore[arg-type]
    if refusal is not None:
        raise IncompatibleConfigError({"adapter": adapter, "strategy": preset}, refusal.reason, refusal.fix)


def adapter_kind(cfg: Any) -> str:
    """``adapter.kind`` of a composed config (``none`` without an ``adapter`` group)."""
    node: Any = cfg.get("adapter") if hasattr(cfg, "get") else None
    return str(node.get("kind", "none")) if hasattr(node, "get") else "none"


def config_techniques(cfg: Any, precision: dict[str, Any]) -> tuple[str, ...]:
    """The rows of the rewrite table a composed config turns on (precision, ``activations``, ``compile``, ``loss``)."""
    found = []
    if precision.get("backend") is not None:
        found.append("fp8")
    elif _transforms_model(precision):
        found.append("keep_fp32")
    targets = [str(node.get("_target_", "")) for node in (cfg.get("activations") or {}).values() if node]
    for name, technique in (
        ("ActivationCheckpointing", "checkpoint"),
        ("ActivationOffload", "offload"),
        ("ActivationCompression", "int8"),
    ):
        if any(t.endswith(name) for t in targets):
            found.append(technique)
    if cfg.get("compile"):
        found.append("compile")
    loss = cfg.get("loss") or {}
    if str(loss.get("_target_", "")).endswith("ChunkedLMHeadLoss"):
        found.append("chunked_ce")
    return tuple(found)


def preflight_from_cfg(cfg: Any, n_params: int | None = None, world_size: int | None = None) -> list[str]:
    """Run :func:`preflight` on a composed Hydra config (``cfg.strategy``, ``cfg.precision``, ``cfg.optimizer``...).

    The optional packages the config needs (:func:`required_packages`) are checked first, here in the launching
    process: a missing one is refused before any rank is spawned, not by each rank once the fit has begun.
    ``n_params`` defaults to the ``cfg.model`` shape's count; ``world_size`` to ``trainer.devices x num_nodes`` when
    both are integers.

    Raises:
        MissingDependencyError: a chosen preset needs a package that does not import.
    """
    from omegaconf import OmegaConf

    def plain(node: Any) -> Any:
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    strategy = strategy_spec(cfg.get("strategy"))
    precision = plain(cfg.get("precision")) or {}
    optimizer = plain(cfg.get("optimizer")) or {}
    callbacks = plain(cfg.get("callbacks")) or {}
    trainer = plain(cfg.get("trainer")) or {}
    targets = tuple(str(v.get("_target_", "")) for v in callbacks.values() if isinstance(v, dict))
    non_finite_skip = any(
        str(v.get("_target_", "")).endswith("NonFiniteGuard") and v.get("policy", "skip") == "skip"
        for v in callbacks.values()
        if isinstance(v, dict)
    )
    if n_params is None:
        n_params = _config_params(cfg)
    if world_size is None:
        devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
        world_size = devices * nodes if isinstance(devices, int) and devices > 0 and isinstance(nodes, int) else 1
    # Only the loggers' _target_: their other values interpolate ${hydra:runtime.output_dir}.
    loggers = cfg.get("logger") or {}
    logger_targets = tuple(
        (str(name), str(node.get("_target_", ""))) for name, node in loggers.items() if hasattr(node, "get")
    )
    p = PreflightInput(
        strategy=strategy,
        precision=str(precision.get("trainer_precision", "32-true")),
        optimizer_target=optimizer.get("_target_"),
        accelerator=str(trainer.get("accelerator", "auto")),
        callback_targets=targets,
        non_finite_skip=non_finite_skip,
        n_params=n_params,
        world_size=world_size,
        precision_preset=precision.get("name"),
        logger_targets=logger_targets,
        fp8_backend=precision.get("backend"),
        fp8_emulate=precision.get("emulate"),
        transforms_model=_transforms_model(precision),
        techniques=config_techniques(cfg, precision),
        tensor_parallel=tensor_parallel_size(cfg),
        adapter=adapter_kind(cfg),
    )
    check_packages(required_packages(p))
    check_tensor_parallel(cfg)
    _check_adapter(cfg, precision)
    return preflight(p)


def _check_adapter(cfg: Any, precision: dict[str, Any]) -> None:
    """The ``adapter`` group's own pre-flight (``config/adapter_preflight.py``)."""
    from lightning_trainopt.config.adapter_preflight import check_adapter
    from lightning_trainopt.config.run_spec import adapter_spec

    check_adapter(cfg, adapter_spec(cfg), precision)


def _transforms_model(precision: dict[str, Any]) -> bool:
    """The precision node changes the model (an FP8 preset, or ``keep_fp32`` under a non-fp32 preset)."""
    if precision.get("backend") is not None:
        return True
    return bool(precision.get("keep_fp32")) and precision.get("trainer_precision") != "32-true"


def _config_params(cfg: Any) -> int | None:
    """The parameter count of ``cfg.model``: a GPT preset's shape, a Hugging Face model built on the meta device;
    ``None`` for a user's module (building it may need more than its config)."""
    from lightning_trainopt.config.model_factory import count_params, meta_module, model_kind

    model = cfg.get("model")
    if model is None:
        return None
    kind = model_kind(model)
    if kind == "gpt":
        from omegaconf import OmegaConf

        from lightning_trainopt.models.config import GPTConfig

        shape = OmegaConf.to_container(model, resolve=True)
        assert isinstance(shape, dict)
        return GPTConfig(**{str(k): v for k, v in shape.items() if k != "_target_"}).n_params()
    if kind == "hf":
        return count_params(meta_module(cfg))
    return None


def compatibility_matrix_markdown() -> str:
    """The refused combinations as a markdown table (pasted into docs/strategies.md)."""
    lines = ["| combination | why it is refused | use instead |", "|---|---|---|"]
    lines += [f"| {r.combination} | {r.reason} | {r.fix} |" for r in RULES]
    from lightning_trainopt.parallel.compat_table import refusals_markdown

    return "\n".join([*lines, refusals_markdown()])
