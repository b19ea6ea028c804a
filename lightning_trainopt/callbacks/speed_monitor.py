"""SpeedMonitor: tokens/s, samples/s, model TFLOP/s, MFU and HFU per device and in total."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_trainopt.callbacks._common import (
    Clock,
    StepEdge,
    check_log_every,
    default_clock,
    json_safe,
    log_interval,
    log_metrics,
)
from lightning_trainopt.core.flops import count_flops, transformer_flops
from lightning_trainopt.core.hardware import HardwareSpec, compute_dtype_key, hardware_spec
from lightning_trainopt.core.throughput import batch_size_of, throughput
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.config import GPTConfig

__all__ = ["SpeedMonitor"]


def checkpointed_fraction(module: torch.nn.Module, n_blocks: int | None) -> float:
    """Share of transformer blocks whose forward is recomputed in backward.

    Counts modules wrapped by our ``ActivationCheckpointing`` (``techniques.checkpointing.is_checkpointed``) and
    torch's ``CheckpointWrapper``. Without ``n_blocks`` (not our model) any wrapper counts as 1.
    """
    from lightning_trainopt.techniques.checkpointing import is_checkpointed

    wrapped = sum(1 for m in module.modules() if type(m).__name__ == "CheckpointWrapper" or is_checkpointed(m))
    if not wrapped:
        return 0.0
    return min(1.0, wrapped / n_blocks) if n_blocks else 1.0


class SpeedMonitor(Callback):
    """Throughput with honest MFU/HFU, logged once per window without synchronising any step.

    FLOPs per batch come from the analytic formula when the module carries a :class:`GPTConfig` (``config``), from a
    ``flops_per_batch_fn`` you give, or from ``torch.utils.flop_counter`` on a meta-device copy of the module's forward.
    MFU counts model FLOPs (3x forward); HFU adds the recomputed forward of checkpointed blocks.

    Args:
        log_every_n_steps: window in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        hardware: a :class:`HardwareSpec` or preset name; default ``auto`` (the current device).
        peak_tflops: override the dense peak TFLOP/s per device for the precision in use (needed for MFU on CPU).
        samples_fn: ``batch -> int`` samples of a micro-batch (default: inferred from shapes).
        tokens_fn: ``batch -> int | Tensor`` tokens of a micro-batch (default: shapes, or an attention mask's sum).
        flops_per_batch_fn: ``batch -> int`` model FLOPs (forward + backward) of a micro-batch.
        recompute_fraction: share of the forward recomputed in backward, for HFU (default: detected).
        warmup_steps: optimizer steps left out of the end-of-fit figures.
        clock: seconds since an arbitrary origin (tests inject a fake).

    Example::

        trainer = Trainer(callbacks=[SpeedMonitor(hardware="h100_sxm")])
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        hardware: HardwareSpec | str | None = None,
        peak_tflops: float | None = None,
        samples_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], Any] | None = None,
        flops_per_batch_fn: Callable[[Any], int] | None = None,
        recompute_fraction: float | None = None,
        warmup_steps: int = 1,
        clock: Clock | None = None,
    ) -> None:
        check_log_every("callbacks.speed_monitor.log_every_n_steps", log_every_n_steps)
        if peak_tflops is not None and not peak_tflops > 0:
            raise ConfigError("callbacks.speed_monitor.peak_tflops", peak_tflops, "use a positive TFLOP/s figure.")
        if recompute_fraction is not None and not 0.0 <= recompute_fraction <= 1.0:
            raise ConfigError(
                "callbacks.speed_monitor.recompute_fraction", recompute_fraction, "use a value in [0, 1]."
            )
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError("callbacks.speed_monitor.warmup_steps", warmup_steps, "use an integer >= 0.")
        self.log_every_n_steps = log_every_n_steps
        self.hardware = hardware
        self.peak_tflops = peak_tflops
        self.samples_fn = samples_fn
        self.tokens_fn = tokens_fn
        self.flops_per_batch_fn = flops_per_batch_fn
        self.recompute_fraction = recompute_fraction
        self.warmup_steps = warmup_steps
        self._clock = clock or default_clock
        self._edge = StepEdge()
        self._spec: HardwareSpec | None = None
        self._peak: float | None = None
        self._dtype = "fp32"
        self._flops_source = "none"
        self._flops_cache: dict[Any, tuple[int, int] | None] = {}
        self._recompute = 0.0
        self._totals = {"seconds": 0.0, "samples": 0, "tokens": 0, "model_flops": 0, "hardware_flops": 0}
        self._reset_window()

    def _reset_window(self) -> None:
        self._w_samples = 0
        self._w_tokens: int | torch.Tensor = 0
        self._w_model_flops = 0
        self._w_hw_flops = 0
        self._w_start: float | None = None
        self._w_flops_known = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        spec = self.hardware
        self._spec = spec if isinstance(spec, HardwareSpec) else hardware_spec(spec or "auto")
        on_gpu = trainer.strategy.root_device.type == "cuda"
        self._dtype = compute_dtype_key(str(trainer.precision), on_gpu, torch.get_float32_matmul_precision())
        self._peak = self.peak_tflops * 1e12 if self.peak_tflops else self._spec.peak(self._dtype)
        if self._peak is None:
            rank_zero_info(
                f"SpeedMonitor: MFU/HFU omitted: no peak FLOP/s known for {self._spec.name} in {self._dtype}; "
                f"pass peak_tflops= (or hardware.peak_tflops.{self._dtype}=...)."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cfg = getattr(pl_module, "config", None)
        n_blocks = cfg.n_layers if isinstance(cfg, GPTConfig) else None
        self._recompute = (
            self.recompute_fraction
            if self.recompute_fraction is not None
            else checkpointed_fraction(pl_module, n_blocks)
        )
        self._edge.reset(trainer)
        self._start_step = trainer.global_step
        self._reset_window()

    def _batch_flops(
        self, pl_module: pl.LightningModule, batch: Any, seq_len: int | None, samples: int
    ) -> tuple[int, int] | None:
        """(model FLOPs, hardware FLOPs) of one micro-batch, cached per shape."""
        if self.flops_per_batch_fn is not None:
            self._flops_source = "flops_per_batch_fn"
            f = int(self.flops_per_batch_fn(batch))
            return f, int(round(f * (1 + self._recompute / 3)))
        key = (samples, seq_len)
        if key in self._flops_cache:
            return self._flops_cache[key]
        cfg = getattr(pl_module, "config", None)
        result: tuple[int, int] | None
        if isinstance(cfg, GPTConfig) and seq_len is not None:
            self._flops_source = "analytic transformer formula"
            tf = transformer_flops(cfg, seq_len, samples)
            result = (tf.train, tf.hardware_train(self._recompute))
        else:
            self._flops_source = "torch.utils.flop_counter on a meta copy"
            inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
            f = count_flops(pl_module, inputs, share=(pl_module.trainer,))
            result = (f, int(round(f * (1 + self._recompute / 3))))
        self._flops_cache[key] = result
        return result

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._w_start is None:
            self._w_start = self._clock()
        size = batch_size_of(batch) if self.samples_fn is None or self.tokens_fn is None else None
        samples = self.samples_fn(batch) if self.samples_fn else size.samples  # type: ignore[union-attr]
        tokens = self.tokens_fn(batch) if self.tokens_fn else size.tokens  # type: ignore[union-attr]
        self._w_samples += int(samples)
        self._w_tokens = self._w_tokens + tokens
        flops = self._batch_flops(pl_module, batch, size.seq_len if size else None, int(samples))
        if flops is None:
            self._w_flops_known = False
        else:
            self._w_model_flops += flops[0]
            self._w_hw_flops += flops[1]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._edge.crossed(trainer):
            return
        step = trainer.global_step
        if step - self._start_step <= self.warmup_steps:
            self._reset_window()
            return
        if step % log_interval(trainer, self.log_every_n_steps) == 0:
            self._close_window(trainer, pl_module)

    def _close_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._w_start is None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # once per window: the window's GPU work is done
        seconds = self._clock() - self._w_start
        tokens = int(self._w_tokens.item()) if isinstance(self._w_tokens, torch.Tensor) else int(self._w_tokens)
        if seconds <= 0:
            self._reset_window()
            return
        known = self._w_flops_known
        tp = throughput(
            seconds,
            self._w_samples,
            tokens,
            trainer.world_size,
            self._w_model_flops if known else None,
            self._w_hw_flops if known else None,
            self._peak,
        )
        t = self._totals
        t["seconds"] += seconds
        t["samples"] += self._w_samples
        t["tokens"] += tokens
        t["model_flops"] += self._w_model_flops
        t["hardware_flops"] += self._w_hw_flops
        metrics = {f"throughput/{k}": v for k, v in tp.to_dict().items() if v is not None and k != "seconds"}
        log_metrics(trainer, metrics)
        self._reset_window()
        self._w_start = self._clock()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._world_size = trainer.world_size

    def summary(self) -> dict[str, Any]:
        """``{"throughput": {...}}``: run means over all closed windows (warm-up excluded) for metrics.json."""
        t = self._totals
        out: dict[str, Any] = {
            "dtype": self._dtype,
            "peak_tflops": self._peak / 1e12 if self._peak else None,
            "peak_source": (self._spec.sources.get("peak") if self._spec else None)
            if not self.peak_tflops
            else "user-set (peak_tflops)",
            "hardware": self._spec.name if self._spec else None,
            "flops_source": self._flops_source,
            "recompute_fraction": self._recompute,
            "seconds": t["seconds"],
            "tokens": t["tokens"],
        }
        if t["seconds"] > 0:
            tp = throughput(
                t["seconds"],
                int(t["samples"]),
                int(t["tokens"]),
                getattr(self, "_world_size", 1),
                int(t["model_flops"]) or None,
                int(t["hardware_flops"]) or None,
                self._peak,
            )
            out.update(tp.to_dict())
            out["flops_per_token"] = t["model_flops"] / t["tokens"] if t["tokens"] else None
        return {"throughput": json_safe(out)}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self._totals)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._totals = dict(state_dict["totals"])
