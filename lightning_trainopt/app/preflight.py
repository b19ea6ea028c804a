"""Pre-flight compatibility checks: refuse known-bad strategy combinations before any process spawns.

The same rules render the documentation table (:func:`compatibility_matrix_markdown`), so docs and code agree.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.precision.plugins import FP16_FSDP2_FIX, FP16_FSDP2_REASON

__all__ = [
    "PreflightInput",
    "RULES",
    "Rule",
    "compatibility_matrix_markdown",
    "estimate_nvme_bytes",
    "preflight",
    "preflight_from_cfg",
    "size_advice",
]

_DS_TARGETS = ("TrainOptDeepSpeedStrategy", "DeepSpeedStrategy")
_FSDP2_TARGETS = ("TrainOptFSDPStrategy", "ModelParallelStrategy")
_FSDP1_TARGETS = ("FSDPStrategy",)
_ADAM_TARGETS = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.adamw.AdamW", "torch.optim.adam.Adam")


@dataclass(frozen=True)
class PreflightInput:
    """What the checks look at, extracted from the composed config.

    Args:
        strategy: the ``strategy`` node as a plain dict (``_target_``, ``name``, kwargs) or ``None``.
        precision: the Trainer precision string (``32-true``, ``bf16-mixed``, ``16-mixed``, ``transformer-engine``...)
            or ``fp8`` for torchao float8 training.
        optimizer_target: the optimizer's ``_target_`` (``torch.optim.AdamW``, ``bitsandbytes.optim.AdamW8bit``...).
        accelerator: ``cpu``, ``gpu``/``cuda`` or ``auto`` (resolved against ``torch.cuda.is_available()``).
        callback_targets: ``_target_`` of each configured callback.
        n_params: model parameter count (for advice and the NVMe size estimate), if known.
        world_size: processes in the job (for the NVMe size estimate).
    """

    strategy: dict[str, Any] | None = None
    precision: str = "32-true"
    optimizer_target: str | None = None
    accelerator: str = "auto"
    callback_targets: tuple[str, ...] = ()
    n_params: int | None = None
    world_size: int = 1

    @property
    def target(self) -> str:
        return str((self.strategy or {}).get("_target_", "")).rsplit(".", 1)[-1]

    @property
    def preset(self) -> str:
        s = self.strategy or {}
        return str(s.get("name", self.target or "auto"))

    @property
    def is_deepspeed(self) -> bool:
        return self.target in _DS_TARGETS

    @property
    def is_fsdp(self) -> bool:
        return self.target in _FSDP2_TARGETS + _FSDP1_TARGETS

    def ds_json(self) -> dict[str, Any]:
        config = (self.strategy or {}).get("config")
        if isinstance(config, str):
            from lightning_trainopt.strategies.deepspeed_json import load_deepspeed_json

            return load_deepspeed_json(config)
        return config if isinstance(config, dict) else {}

    def offload(self) -> dict[str, str]:
        """``{"optimizer": cpu|nvme|none, "param": ...}`` as the strategy would configure it."""
        s = self.strategy or {}
        if self.is_deepspeed:
            zero = self.ds_json().get("zero_optimization") or {}
            if zero:
                return {
                    "optimizer": str((zero.get("offload_optimizer") or {}).get("device", "none")),
                    "param": str((zero.get("offload_param") or {}).get("device", "none")),
                }
            return {
                "optimizer": str(s.get("offload_optimizer_device", "cpu")) if s.get("offload_optimizer") else "none",
                "param": str(s.get("offload_params_device", "cpu")) if s.get("offload_parameters") else "none",
            }
        if self.is_fsdp and s.get("cpu_offload"):
            return {"optimizer": "cpu", "param": "cpu"}
        return {"optimizer": "none", "param": "none"}

    def on_cpu(self) -> bool:
        if self.accelerator == "cpu":
            return True
        if self.accelerator in ("gpu", "cuda"):
            return False
        import torch

        return not torch.cuda.is_available()


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
    return bool(target) and ("bitsandbytes" in target or "8bit" in target.lower() or "torchao" in target)


def _fp8(p: PreflightInput) -> bool:
    return p.precision.startswith("transformer-engine") or p.precision == "fp8"


def _ds_optimizer_block(p: PreflightInput) -> bool:
    return p.is_deepspeed and "optimizer" in p.ds_json()


RULES: tuple[Rule, ...] = (
    Rule(
        "FP8 + DeepSpeed or FSDP",
        "Lightning runs one precision plugin per strategy: DeepSpeedPrecision and FSDP/ModelParallel precision "
        "reject transformer-engine FP8 (Lightning #18820, #18679).",
        "use FP8 with ddp (+strategy=ddp), or bf16 with the sharded preset.",
        lambda p: _fp8(p) and (p.is_deepspeed or p.is_fsdp),
        lambda p: {"precision": p.precision, "strategy": p.preset},
    ),
    Rule(
        "8-bit optimizer + offload",
        "offload steps the optimizer on the CPU with DeepSpeed's CPU Adam (or FSDP's CPU copy); 8-bit optimizer "
        "states cannot be offloaded (DeepSpeed #6666) and DeepSpeed refuses a client optimizer under offload.",
        "drop the offload (zero1/zero2 keep 8-bit states) or use optimizer=adamw with the offload preset.",
        lambda p: _is_8bit(p.optimizer_target) and p.offload()["optimizer"] != "none",
        lambda p: {"optimizer": p.optimizer_target, "strategy": p.preset},
    ),
    Rule(
        "8-bit optimizer + FSDP",
        "FSDP2 parameters are DTensors and bitsandbytes' fused 8-bit update mixes them with plain tensors: "
        "'optimizer_update_8bit_blockwise got mixed torch.Tensor and DTensor' (measured; bitsandbytes #89 reports "
        "the same class of failure for FSDP1).",
        "use the 8-bit optimizer with zero1/zero2/zero3 (DeepSpeed hands it flat local partitions) or adamw with fsdp.",
        lambda p: _is_8bit(p.optimizer_target) and p.is_fsdp,
        lambda p: {"optimizer": p.optimizer_target, "strategy": p.preset},
    ),
    Rule(
        "non-Adam optimizer + offload",
        "ZeRO-Offload needs DeepSpeed's CPU optimizer; only torch Adam/AdamW have a drop-in CPU Adam, any other "
        "client optimizer makes DeepSpeed raise ZeRORuntimeException.",
        "use optimizer=adamw (replaced by DeepSpeedCPUAdam automatically) or a preset without offload.",
        lambda p: (
            p.is_deepspeed
            and p.offload()["optimizer"] != "none"
            and not _ds_optimizer_block(p)
            and not _is_8bit(p.optimizer_target)
            and p.optimizer_target is not None
            and p.optimizer_target not in _ADAM_TARGETS
        ),
        lambda p: {"optimizer": p.optimizer_target, "strategy": p.preset},
    ),
    Rule(
        "GradientAccumulationScheduler + DeepSpeed",
        "DeepSpeed fixes gradient_accumulation_steps in its config at start-up; Lightning raises when the scheduler "
        "changes accumulation between epochs.",
        "use a constant trainer.accumulate_grad_batches, or ddp/fsdp with the scheduler.",
        lambda p: p.is_deepspeed and any(t.endswith("GradientAccumulationScheduler") for t in p.callback_targets),
        lambda p: {"callbacks": "GradientAccumulationScheduler", "strategy": p.preset},
    ),
    Rule(
        "fp16 AMP + FSDP2",
        FP16_FSDP2_REASON,
        FP16_FSDP2_FIX,
        lambda p: p.precision == "16-mixed" and p.target in _FSDP2_TARGETS,
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
        lambda p: "nvme" in p.offload().values() and not _async_io_ok(),
        lambda p: {"strategy": p.preset, "async_io": "unavailable"},
        machine_specific=True,
    ),
    Rule(
        "FSDP1 on CPU",
        "torch's FullyShardedDataParallel (Lightning FSDPStrategy) raises 'FSDP needs a non-CPU accelerator device'.",
        "use +strategy=fsdp (FSDP2 fully_shard through ModelParallelStrategy), which runs on CPU.",
        lambda p: p.target in _FSDP1_TARGETS and p.on_cpu(),
        lambda p: {"strategy": p.preset, "trainer.accelerator": "cpu"},
    ),
)


def _async_io_ok() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return False
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def estimate_nvme_bytes(n_params: int, world_size: int, offload: dict[str, str]) -> int:
    """Swap bytes on one node: fp32 master + 2 Adam moments (12 B/param) and half weights (2 B/param)."""
    per_param = (12 if offload.get("optimizer") == "nvme" else 0) + (2 if offload.get("param") == "nvme" else 0)
    return n_params * per_param  # the shards of all ranks on one node add up to the whole model


def _check_nvme(p: PreflightInput) -> None:
    if "nvme" not in p.offload().values():
        return
    s = p.strategy or {}
    zero = p.ds_json().get("zero_optimization") or {}
    path = (zero.get("offload_optimizer") or zero.get("offload_param") or {}).get("nvme_path") or s.get("nvme_path")
    if not path or not os.path.isdir(path):
        raise ConfigError("strategy.nvme_path", path, "point it at an existing directory on a local NVMe drive.")
    if not os.access(path, os.W_OK):
        raise ConfigError("strategy.nvme_path", path, "the directory is not writable by this user; choose another.")
    if p.n_params:
        need = estimate_nvme_bytes(p.n_params, p.world_size, p.offload())
        free = shutil.disk_usage(path).free
        if free < need:
            raise ConfigError(
                "strategy.nvme_path",
                path,
                f"{free / 2**30:.1f} GiB free but the swap needs about {need / 2**30:.1f} GiB "
                f"({p.n_params:,} params); free space or pick a larger drive.",
            )


def size_advice(n_params: int, preset: str, offload: dict[str, str] | None = None) -> str | None:
    """Rule-of-thumb advice (never enforced): <1B DDP; 1-10B DP + ZeRO-2; 10-100B ZeRO-3 + TP; >100B PP + TP + DP."""
    offload = offload or {}
    offloading = any(v != "none" for v in offload.values())
    billions = n_params / 1e9
    if billions < 1:
        suggested = "ddp"
        far = preset.startswith("zero3") or preset == "zero_infinity" or offloading
    elif billions < 10:
        suggested = "zero2"
        far = preset == "zero_infinity"
    elif billions < 100:
        suggested = "zero3 (with tensor parallelism)"
        far = preset in ("ddp", "zero1")
    else:
        suggested = "pipeline + tensor + data parallelism"
        far = preset in ("ddp", "zero1", "zero2")
    if not far:
        return None
    return (
        f"Advice: a {billions:.2g}B-parameter model usually trains best with {suggested}; {preset!r} "
        f"{'adds sharding/offload traffic it does not need' if billions < 10 else 'may not fit'}. "
        "(Rule of thumb only; nothing was changed.)"
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
    _check_nvme(p)
    advice = size_advice(p.n_params, p.preset, p.offload()) if p.n_params and p.strategy else None
    return [advice] if advice else []


def preflight_from_cfg(cfg: Any, n_params: int | None = None, world_size: int | None = None) -> list[str]:
    """Run :func:`preflight` on a composed Hydra config (``cfg.strategy``, ``cfg.precision``, ``cfg.optimizer``...).

    ``n_params`` defaults to the ``cfg.model`` shape's count; ``world_size`` to ``trainer.devices x num_nodes`` when
    both are integers.
    """
    from omegaconf import OmegaConf

    def plain(node: Any) -> Any:
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    strategy = plain(cfg.get("strategy"))
    precision = plain(cfg.get("precision")) or {}
    optimizer = plain(cfg.get("optimizer")) or {}
    callbacks = plain(cfg.get("callbacks")) or {}
    trainer = plain(cfg.get("trainer")) or {}
    targets = tuple(str(v.get("_target_", "")) for v in callbacks.values() if isinstance(v, dict))
    model = plain(cfg.get("model"))
    if n_params is None and isinstance(model, dict):
        from lightning_trainopt.models.config import GPTConfig

        n_params = GPTConfig(**{k: v for k, v in model.items() if k != "_target_"}).n_params()
    if world_size is None:
        devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
        world_size = devices * nodes if isinstance(devices, int) and devices > 0 and isinstance(nodes, int) else 1
    return preflight(
        PreflightInput(
            strategy=strategy,
            precision=str(precision.get("trainer_precision", "32-true")),
            optimizer_target=optimizer.get("_target_"),
            accelerator=str(trainer.get("accelerator", "auto")),
            callback_targets=targets,
            n_params=n_params,
            world_size=world_size,
        )
    )


def compatibility_matrix_markdown() -> str:
    """The refused combinations as a markdown table (pasted into docs/strategies.md)."""
    lines = ["| combination | why it is refused | use instead |", "|---|---|---|"]
    lines += [f"| {r.combination} | {r.reason} | {r.fix} |" for r in RULES]
    return "\n".join(lines)
