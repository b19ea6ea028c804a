"""Per-key checks of a training config, run before any model is built, process spawned or log directory touched."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from lightning_trainopt.config.keys import check_config_keys
from lightning_trainopt.config.model_factory import model_kind, user_module_class
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.optim.schedules import check_warmup_cosine

__all__ = ["APP_TRAINER_KEYS", "resolve_accelerator", "validate_config"]

# Trainer arguments that train(cfg) sets itself from other groups: given again under `trainer`, the Trainer call
# would fail with "got multiple values for keyword argument" (or one of the two would be silently dropped).
APP_TRAINER_KEYS: dict[str, str] = {
    "precision": "remove it and choose the precision group instead, e.g. precision=bf16 (presets in conf/precision/).",
    "plugins": "remove it: the precision plugin comes from the precision group (e.g. precision=fp16 "
    "precision.init_scale=1024) and the strategy from +strategy=<name>.",
    "strategy": "remove it and choose the strategy group instead, e.g. +strategy=zero2 (presets in conf/strategy/).",
    "callbacks": "remove it and use the callbacks group instead, e.g. callbacks=default or "
    "+callbacks.<name>={_target_: ...}.",
    "logger": "remove it and choose the logger group instead: logger=csv, logger=tensorboard or logger=none.",
    "default_root_dir": "remove it: the run directory is Hydra's output directory; set hydra.run.dir=... instead.",
}

_MAX_SEED = 2**32 - 1  # numpy's bound, which Lightning's seed_everything enforces
_DURATION = re.compile(r"^\d+:\d+:\d+:\d+$")  # Lightning's time-based val_check_interval, "DD:HH:MM:SS"


def resolve_accelerator(accelerator: str) -> str:
    """``cpu`` or ``gpu``: what ``auto`` means on this machine."""
    if accelerator in ("gpu", "cuda"):
        return "gpu"
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return accelerator


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """A list or dict node as plain Python, so that the error shows ``[0.9]`` rather than a node type."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value)
    return value


def _not_a_string(value: Any) -> str:
    """The part of a fix for a string where a number belongs (``optimizer.lr='3e-4'`` reaches us as a string)."""
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return "give a number; "
    return "give a number, not a string (drop the quotes); "


def _positive_int(key: str, value: Any, fix: str) -> None:
    if not _is_int(value) or value < 1:
        raise ConfigError(key, value, fix)


def _boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, value, f"use true or false (got a {type(value).__name__}).")


def _check_devices(accelerator: str, devices: Any, given: Any) -> None:
    if accelerator == "gpu" and torch.cuda.device_count() == 0:
        raise ConfigError(
            "trainer.accelerator",
            given,
            "this machine has no CUDA device; use trainer.accelerator=cpu (or auto), "
            "or trainer=ddp_sim to simulate 2 processes on CPU.",
        )
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


def _check_val_check_interval(trainer: DictConfig) -> None:
    """The forms Lightning accepts, each with a value that cannot divide by zero or never validate."""
    key, value = "trainer.val_check_interval", trainer.get("val_check_interval")
    if value is None:
        return
    if _is_int(value):
        if value < 1:
            raise ConfigError(key, value, "use a positive number of training batches, e.g. 100 (or null).")
        return
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ConfigError(
                key, value, "a float is a fraction of an epoch in (0, 1]; for a number of batches use an integer >= 1."
            )
        if trainer.get("check_val_every_n_epoch") is None:
            raise ConfigError(
                key,
                value,
                "a fraction of an epoch needs trainer.check_val_every_n_epoch=1 (null counts batches across epochs); "
                "or use an integer number of batches, e.g. 100.",
            )
        return
    seconds = None
    if isinstance(value, str) and _DURATION.match(value):
        days, hours, minutes, secs = (int(part) for part in value.split(":"))
        seconds = timedelta(days=days, hours=hours, minutes=minutes, seconds=secs).total_seconds()
    elif isinstance(value, DictConfig):
        try:
            seconds = timedelta(**_plain(value)).total_seconds()
        except (TypeError, ValueError):
            seconds = None
    if seconds is None or seconds <= 0:
        raise ConfigError(
            key,
            _plain(value),
            "use a positive integer number of batches (e.g. 100), a fraction of an epoch in (0, 1], "
            "a positive duration 'DD:HH:MM:SS', or null.",
        )


def _check_trainer(trainer: DictConfig) -> str:
    """Check the ``trainer`` group; return the accelerator it resolves to on this machine."""
    for name, fix in APP_TRAINER_KEYS.items():
        if name in trainer:
            raise ConfigError(f"trainer.{name}", _plain(trainer[name]), f"train.py sets this Trainer argument; {fix}")
    _positive_int("trainer.max_steps", trainer.max_steps, "use a positive number of optimizer steps, e.g. 300.")
    _positive_int(
        "trainer.accumulate_grad_batches",
        trainer.get("accumulate_grad_batches", 1),
        "use a positive integer number of micro-batches per optimizer step.",
    )
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not (_is_number(clip) and clip > 0):
        raise ConfigError(
            "trainer.gradient_clip_val",
            clip,
            f"{_not_a_string(clip)}use a positive norm, e.g. 1.0, or null to switch clipping off.",
        )
    _check_val_check_interval(trainer)
    given = trainer.get("accelerator", "auto")
    accelerator = resolve_accelerator(str(given))
    _check_devices(accelerator, trainer.get("devices", 1), given)
    return accelerator


def _check_optimizer(optimizer: DictConfig) -> None:
    lr = optimizer.get("lr")
    if lr is not None and not (_is_number(lr) and lr > 0):
        raise ConfigError("optimizer.lr", lr, f"{_not_a_string(lr)}use a positive learning rate, e.g. 3e-4.")
    decay = optimizer.get("weight_decay")
    if decay is not None and not (_is_number(decay) and decay >= 0):
        raise ConfigError(
            "optimizer.weight_decay", decay, f"{_not_a_string(decay)}use a number >= 0, e.g. 0.1 (0: no decay)."
        )
    eps = optimizer.get("eps")
    if eps is not None and not (_is_number(eps) and eps >= 0):
        raise ConfigError("optimizer.eps", eps, f"{_not_a_string(eps)}use a small number >= 0, e.g. 1e-8.")
    betas = optimizer.get("betas")
    if betas is not None and not (
        isinstance(betas, (ListConfig, list, tuple))
        and len(betas) == 2
        and all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ConfigError(
            "optimizer.betas", _plain(betas), "give two numbers in [0, 1), e.g. optimizer.betas=[0.9,0.95]."
        )


def _check_scheduler(scheduler: DictConfig, max_steps: int) -> None:
    """Warmup and floor of a warmup-cosine schedule, by the check the schedule itself runs in configure_optimizers.

    Without ``trainer.max_epochs``, Lightning's ``estimated_stepping_batches`` (the schedule's total) is
    ``trainer.max_steps``.
    """
    if not any(key in scheduler for key in ("warmup_steps", "warmup_ratio", "min_lr_ratio")):
        return
    check_warmup_cosine(
        scheduler.get("warmup_steps"),
        max_steps,
        scheduler.get("min_lr_ratio", 0.0),
        warmup_ratio=scheduler.get("warmup_ratio"),
    )


def _check_callback_schedules(callbacks: DictConfig, max_steps: Any) -> None:
    """A ``WarmupCosineLR`` callback's warmup against its total (``total_steps``, else ``trainer.max_steps``), by the
    check it runs itself at fit start, so a warmup longer than the run is refused before training."""
    for name, node in callbacks.items():
        if not isinstance(node, DictConfig) or not str(node.get("_target_", "")).endswith("WarmupCosineLR"):
            continue
        total = node.get("total_steps")
        if total is None and _is_int(max_steps) and max_steps >= 1:
            total = max_steps
        # An epoch-based run without total_steps: the total is known only once the data loaders exist.
        check_warmup_cosine(
            node.get("warmup_steps"),
            total,
            node.get("min_lr_ratio", 0.0),
            prefix=f"callbacks.{name!s}",
            warmup_ratio=node.get("warmup_ratio"),
        )


def _check_data(data: DictConfig) -> None:
    """The data node's own values (those of our ``TextDataModule``; a user's data module checks its own)."""
    if "seq_len" in data:
        _positive_int("data.seq_len", data.seq_len, "use a positive sequence length.")
    if "batch_size" in data:
        _positive_int("data.batch_size", data.batch_size, "use a positive micro-batch size per device.")
    if data.get("corpus") == "text_file" and not data.get("path"):
        raise ConfigError("data.path", data.get("path"), "data=text_file needs data.path=/path/to/file_or_folder.")
    max_bytes = data.get("max_bytes")
    if max_bytes is not None and not (_is_int(max_bytes) and max_bytes >= 1):
        raise ConfigError(
            "data.max_bytes", max_bytes, "use a positive number of bytes to read, or null to read all the text."
        )
    fraction = data.get("val_fraction")
    if fraction is not None and not (_is_number(fraction) and 0.0 < fraction < 1.0):
        raise ConfigError(
            "data.val_fraction", fraction, f"{_not_a_string(fraction)}use a fraction between 0 and 1, e.g. 0.02."
        )


def _check_user_targets(cfg: DictConfig) -> None:
    """``model=module`` and ``data=datamodule`` name a LightningModule and a LightningDataModule class (checked before
    their keys are bound to those classes)."""
    if model_kind(cfg.model) == "module":
        user_module_class(str(cfg.model._target_))
    data = cfg.data
    if OmegaConf.is_missing(data, "_target_"):
        raise ConfigError(
            "data._target_",
            "???",
            "data=datamodule needs the class of your LightningDataModule: data._target_=pkg.module.MyData "
            "(and its arguments as +data.ARG=...).",
        )


def _check_gpt(data: DictConfig, model: DictConfig) -> None:
    """Our GPT presets' shape against the data: sequence length and byte vocabulary."""
    _positive_int("model.max_seq_len", model.max_seq_len, "use a positive number of tokens, e.g. 512.")
    _positive_int("model.vocab_size", model.vocab_size, "use a positive number of token ids, e.g. 256.")
    max_len = model.max_seq_len
    seq_len = data.get("seq_len")
    if _is_int(seq_len) and seq_len > max_len:
        raise ConfigError(
            "data.seq_len",
            seq_len,
            f"model {model.name} handles at most model.max_seq_len={max_len} tokens; "
            f"use data.seq_len<={max_len} or raise model.max_seq_len.",
        )
    if data.get("corpus") not in (None, "synthetic") and model.vocab_size < 256:
        raise ConfigError(
            "model.vocab_size", model.vocab_size, "byte-level text needs at least 256 token ids; use >= 256."
        )


def _text_vocab(data: DictConfig) -> int | None:
    """Token ids our ``TextDataModule`` produces (bytes: 256; synthetic: ``data.vocab_size``), else ``None``."""
    if "corpus" not in data:
        return None
    if data.corpus != "synthetic":
        return 256
    try:
        vocab = data.get("vocab_size")
    except InterpolationResolutionError:
        raise ConfigError(
            "data.vocab_size",
            "${model.vocab_size}",
            "this model has no model.vocab_size to take it from; give data.vocab_size=N (at most the model's).",
        ) from None
    return vocab if _is_int(vocab) else None


def _check_hf(data: DictConfig, model: DictConfig, accelerator: str, strategy: DictConfig | None) -> None:
    """A Hugging Face model from local files only: paths, weights, overrides, attention kernel, length, vocabulary."""
    from hydra.utils import instantiate

    from lightning_trainopt.config.preflight import check_vocab

    spec = instantiate(model)
    spec.check_attention(accelerator)
    hf_config = spec.load()
    max_len = getattr(hf_config, "max_position_embeddings", None)
    seq_len = data.get("seq_len")
    if _is_int(max_len) and _is_int(seq_len) and seq_len > max_len:
        raise ConfigError(
            "data.seq_len",
            seq_len,
            f"the model ({hf_config.model_type}) has {max_len} positions; use data.seq_len<={max_len} or raise "
            f"+model.overrides.max_position_embeddings.",
        )
    check_vocab(int(hf_config.vocab_size), _text_vocab(data), model_key="model.overrides.vocab_size")


def _check_hardware(hardware: DictConfig) -> None:
    price = hardware.get("price_per_device_hour")
    if price is not None and not (_is_number(price) and price >= 0):
        raise ConfigError(
            "hardware.price_per_device_hour",
            price,
            f"{_not_a_string(price)}use dollars per device-hour as a number >= 0, e.g. 2.5, or null for the preset.",
        )
    memory = hardware.get("memory_gb")
    if memory is not None and not (_is_number(memory) and memory > 0):
        raise ConfigError("hardware.memory_gb", memory, f"{_not_a_string(memory)}use a positive size in GiB, e.g. 80.")
    host = hardware.get("host_memory_gb")
    if host is not None and not (_is_number(host) and host > 0):
        raise ConfigError(
            "hardware.host_memory_gb", host, f"{_not_a_string(host)}use the RAM of one node in GiB, e.g. 1024."
        )
    peaks = hardware.get("peak_tflops")
    if peaks is not None and not isinstance(peaks, DictConfig):
        raise ConfigError(
            "hardware.peak_tflops", _plain(peaks), "give TFLOP/s per dtype, e.g. hardware.peak_tflops={bf16:800}."
        )


def _check_run(cfg: DictConfig) -> None:
    seed = cfg.get("seed")
    if not _is_int(seed) or not 0 <= seed <= _MAX_SEED:
        raise ConfigError("seed", seed, f"use an integer from 0 to {_MAX_SEED}, e.g. 1234.")
    if "compile" in cfg:
        _boolean("compile", cfg.compile)
    if "continue_on_oom" in cfg:
        _boolean("continue_on_oom", cfg.continue_on_oom)


def validate_config(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first nonsense value, naming the key, the value and the fix.

    First every key is bound to the signature of what it is passed to (:func:`check_config_keys`: each ``_target_``
    node's keys to its target, the ``trainer`` keys to Lightning's ``Trainer``), and all keys that do not fit are
    reported at once, each with the nearest valid name. Then the values: what a typo or a bad sweep produces, before
    anything is built, spawned or logged: Trainer arguments
    (including those train.py sets from other groups), devices and accelerator on this machine, optimizer and
    schedule hyper-parameters, data and model sizes, the text corpus path, hardware prices, seed and run flags,
    and fp16 on CPU. Arguments of callbacks and data modules are also checked in their ``__init__``.

    Args:
        cfg: the composed config of ``conf/train.yaml`` (or ``conf/plan.yaml``).

    Raises:
        ConfigKeysError: keys that their targets do not take, or required arguments missing (all of them).
        ConfigError: the first invalid value found.
    """
    _check_user_targets(cfg)
    check_config_keys(cfg)
    trainer = cfg.trainer
    accelerator = _check_trainer(trainer)
    _check_run(cfg)
    if cfg.get("optimizer"):
        _check_optimizer(cfg.optimizer)
    if cfg.get("scheduler"):
        _check_scheduler(cfg.scheduler, trainer.max_steps)
    if cfg.get("callbacks"):
        _check_callback_schedules(cfg.callbacks, trainer.max_steps)
    _check_data(cfg.data)
    kind = model_kind(cfg.model)
    if kind == "gpt":
        _check_gpt(cfg.data, cfg.model)
        if accelerator in ("cpu", "gpu"):  # not for a plan of other hardware
            from lightning_trainopt.transforms.attention import check_attention

            check_attention(str(cfg.model.get("attention", "sdpa")), on_cuda=accelerator == "gpu")
    elif kind == "hf":
        _check_hf(cfg.data, cfg.model, accelerator, cfg.get("strategy"))
    if cfg.get("hardware"):
        _check_hardware(cfg.hardware)

    if cfg.precision.trainer_precision.startswith("16") and accelerator == "cpu":
        raise ConfigError(
            "precision",
            cfg.precision.name,
            "fp16 needs a CUDA GPU; on CPU Lightning would silently train in bf16 instead, so we refuse. "
            "Use precision=bf16 (or bf16_true / fp32) on CPU.",
        )
