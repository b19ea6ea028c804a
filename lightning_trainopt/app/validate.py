"""Per-key checks of a training config, run before any model is built or process spawned."""

from __future__ import annotations

import os
from typing import Any

import torch
from omegaconf import DictConfig

from lightning_trainopt.exceptions import ConfigError

__all__ = ["resolve_accelerator", "validate_config"]


def resolve_accelerator(accelerator: str) -> str:
    """``cpu`` or ``gpu``: what ``auto`` means on this machine."""
    if accelerator in ("gpu", "cuda"):
        return "gpu"
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return accelerator


def _positive_int(key: str, value: Any, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, fix)


def _check_devices(accelerator: str, devices: Any) -> None:
    if devices in ("auto", -1):
        return
    if isinstance(devices, (list, tuple)) or (isinstance(devices, str) and "," in devices):
        # An explicit list of device indices: Lightning checks each index itself.
        return
    try:
        n = int(devices)
    except (TypeError, ValueError):
        raise ConfigError("trainer.devices", devices, "use a positive integer, -1 (all) or 'auto'.") from None
    if n < 1:
        raise ConfigError("trainer.devices", devices, "use a positive integer, -1 (all) or 'auto'.")
    if accelerator == "gpu":
        available = torch.cuda.device_count()
        if n > available:
            raise ConfigError(
                "trainer.devices",
                devices,
                f"this machine has {available} CUDA device(s); use trainer.devices<={available}, "
                "or trainer=ddp_sim to simulate 2 processes on CPU.",
            )
    elif accelerator == "cpu":
        available = os.cpu_count() or 1
        if n > available:
            raise ConfigError(
                "trainer.devices",
                devices,
                f"this machine has {available} CPU core(s); one process per core at most: "
                f"use trainer.devices<={available}.",
            )


def validate_config(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first nonsense value, naming the key, the value and the fix.

    Covers the values a typo or a bad sweep produces: learning rate, step budget, warmup, sequence length,
    device count, fp16 on CPU, and the data path (checked by the data module itself).
    """
    trainer = cfg.trainer
    _positive_int("trainer.max_steps", trainer.max_steps, "use a positive number of optimizer steps, e.g. 300.")
    _positive_int(
        "trainer.accumulate_grad_batches",
        trainer.get("accumulate_grad_batches", 1),
        "use a positive integer number of micro-batches per optimizer step.",
    )
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not clip > 0:
        raise ConfigError("trainer.gradient_clip_val", clip, "use a positive norm, or null to switch clipping off.")
    accelerator = resolve_accelerator(str(trainer.get("accelerator", "auto")))
    _check_devices(accelerator, trainer.get("devices", 1))

    lr = cfg.optimizer.get("lr") if cfg.get("optimizer") else None
    if lr is not None and not (isinstance(lr, (int, float)) and lr > 0):
        raise ConfigError("optimizer.lr", lr, "use a positive learning rate, e.g. 3e-4.")

    sched = cfg.get("scheduler")
    if sched and sched.get("warmup_steps") is not None:
        warmup = sched.warmup_steps
        if not isinstance(warmup, int) or warmup < 0:
            raise ConfigError("scheduler.warmup_steps", warmup, "use an integer >= 0.")
        if warmup >= trainer.max_steps:
            raise ConfigError(
                "scheduler.warmup_steps",
                warmup,
                f"warmup must end before the run does (trainer.max_steps={trainer.max_steps}); "
                "lower scheduler.warmup_steps or raise trainer.max_steps.",
            )

    seq_len, max_len = cfg.data.seq_len, cfg.model.max_seq_len
    _positive_int("data.seq_len", seq_len, "use a positive sequence length.")
    _positive_int("data.batch_size", cfg.data.batch_size, "use a positive micro-batch size per device.")
    if seq_len > max_len:
        raise ConfigError(
            "data.seq_len",
            seq_len,
            f"model {cfg.model.name} handles at most model.max_seq_len={max_len} tokens; "
            f"use data.seq_len<={max_len} or raise model.max_seq_len.",
        )
    if cfg.data.corpus != "synthetic" and cfg.model.vocab_size < 256:
        raise ConfigError(
            "model.vocab_size", cfg.model.vocab_size, "byte-level text needs at least 256 token ids; use >= 256."
        )

    if cfg.precision.trainer_precision.startswith("16") and accelerator == "cpu":
        raise ConfigError(
            "precision",
            cfg.precision.name,
            "fp16 needs a CUDA GPU; on CPU Lightning would silently train in bf16 instead, so we refuse. "
            "Use precision=bf16 (or bf16_true / fp32) on CPU.",
        )
