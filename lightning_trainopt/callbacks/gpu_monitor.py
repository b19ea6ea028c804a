"""GPUMonitor: NVML readings sampled in a background thread, logged as window means, never syncing the loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_trainopt.callbacks._common import (
    StepEdge,
    check_log_every,
    json_safe,
    log_metrics,
    warn_off,
)
from lightning_trainopt.exceptions import ConfigError, install_command

__all__ = ["GPUMonitor"]

#: metric names per device, as logged under ``gpu{index}/<name>``.
FIELDS = (
    "util_pct",
    "mem_used_gb",
    "mem_total_gb",
    "power_w",
    "sm_clock_mhz",
    "pcie_tx_mbps",
    "pcie_rx_mbps",
    "temp_c",
)

Reader = Callable[[], dict[int, dict[str, float]]]


def nvml_reader(nvml_indices: list[int]) -> Reader:
    """A function returning ``{device: {field: value}}`` for these NVML indices (fields a device lacks are left out).

    Raises:
        MissingDependencyError: nvidia-ml-py is not installed.
        pynvml.NVMLError: NVML cannot start (no driver).
    """
    try:
        import pynvml
    except ImportError as err:
        from lightning_trainopt.exceptions import MissingDependencyError

        raise MissingDependencyError("pynvml", "nvml", "GPUMonitor") from err
    pynvml.nvmlInit()
    handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in nvml_indices}
    unsupported: set[tuple[int, str]] = set()
    calls: dict[str, Callable[[Any], float]] = {
        "util_pct": lambda h: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
        "mem_used_gb": lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).used / 1e9,
        "mem_total_gb": lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9,
        "power_w": lambda h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
        "sm_clock_mhz": lambda h: float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
        # NVML reports KB/s over a 20 ms sample.
        "pcie_tx_mbps": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES) / 1000.0,
        "pcie_rx_mbps": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) / 1000.0,
        "temp_c": lambda h: float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
    }

    def read() -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for i, h in handles.items():
            row: dict[str, float] = {}
            for name, call in calls.items():
                if (i, name) in unsupported:
                    continue
                try:
                    row[name] = call(h)
                except pynvml.NVMLError_NotSupported:
                    # This device does not expose the field (e.g. power on some virtual GPUs): stop asking.
                    unsupported.add((i, name))
            out[i] = row
        return out

    return read


class _Sampler(threading.Thread):
    """Daemon thread summing readings every ``interval_s``; :meth:`take` returns window means and resets."""

    def __init__(self, reader: Reader, interval_s: float) -> None:
        super().__init__(name="trainopt-gpu-monitor", daemon=True)
        self.reader = reader
        self.interval_s = interval_s
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._sums: dict[tuple[int, str], float] = {}
        self._counts: dict[tuple[int, str], int] = {}
        self.error: BaseException | None = None

    def sample_once(self) -> None:
        readings = self.reader()
        with self._lock:
            for dev, row in readings.items():
                for name, value in row.items():
                    self._sums[(dev, name)] = self._sums.get((dev, name), 0.0) + value
                    self._counts[(dev, name)] = self._counts.get((dev, name), 0) + 1

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.sample_once()
            except Exception as err:  # noqa: BLE001 - re-raised on the training thread by GPUMonitor
                self.error = err
                return
            self._stop_event.wait(self.interval_s)

    def take(self) -> dict[int, dict[str, float]]:
        with self._lock:
            out: dict[int, dict[str, float]] = {}
            for (dev, name), total in self._sums.items():
                out.setdefault(dev, {})[name] = total / self._counts[(dev, name)]
            self._sums, self._counts = {}, {}
        return out

    def stop(self) -> None:
        self._stop_event.set()


class GPUMonitor(Callback):
    """Per-device NVML utilisation, memory, power, SM clock, PCIe throughput and temperature.

    Global rank 0 samples every device its node trains on in a background thread and logs window means at
    each logging window; nothing runs on the training thread between windows. Off (with one warning) without
    CUDA or a working NVML.

    Args:
        interval_s: seconds between samples.
        log_every_n_steps: window in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        target_util_pct: warn when mean utilisation stays below this for ``patience`` windows.
        patience: consecutive low windows before the warning.
        reader: replaces NVML (tests): ``() -> {device: {field: value}}``.

    Example::

        trainer = Trainer(accelerator="gpu", callbacks=[GPUMonitor(target_util_pct=90)])
    """

    def __init__(
        self,
        interval_s: float = 0.5,
        log_every_n_steps: int | None = None,
        target_util_pct: float = 85.0,
        patience: int = 3,
        reader: Reader | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ConfigError("callbacks.gpu_monitor.interval_s", interval_s, "use a positive number of seconds.")
        if not 0 < target_util_pct <= 100:
            raise ConfigError("callbacks.gpu_monitor.target_util_pct", target_util_pct, "use a percentage in (0, 100].")
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError("callbacks.gpu_monitor.patience", patience, "use a positive integer.")
        check_log_every("callbacks.gpu_monitor.log_every_n_steps", log_every_n_steps)
        self.interval_s = interval_s
        self.log_every_n_steps = log_every_n_steps
        self.target_util_pct = target_util_pct
        self.patience = patience
        self._reader = reader
        self._sampler: _Sampler | None = None
        self.enabled = True
        self._low_windows = 0
        self._warned_low = False
        self._run_sums: dict[str, float] = {}
        self._run_counts: dict[str, int] = {}
        self._edge = StepEdge()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        if self._reader is None:
            if trainer.strategy.root_device.type != "cuda":
                self.enabled = False
                warn_off("GPUMonitor", "training does not run on CUDA devices, so there is no GPU to watch.")
                return
            try:
                import pynvml
            except ImportError:
                self.enabled = False
                warn_off("GPUMonitor", f"nvidia-ml-py is not installed ({install_command('nvml')}).")
                return
            from lightning_trainopt._compat.torch_internals import nvml_device_index

            try:
                # torch maps CUDA ordinals to NVML indices through CUDA_VISIBLE_DEVICES, which it cannot always
                # resolve (MIG instance UUIDs): a monitor that cannot start switches off, never the run.
                indices = sorted({nvml_device_index(i) for i in (trainer.device_ids or [0])})
                self._reader = nvml_reader(indices)
            except (pynvml.NVMLError, RuntimeError, ValueError) as err:
                self.enabled = False
                warn_off("GPUMonitor", f"NVML cannot start ({type(err).__name__}: {err}).")
                return
        self.enabled = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._edge.reset(trainer, self.log_every_n_steps)
        if not self.enabled or not trainer.is_global_zero or self._reader is None:
            return
        self._sampler = _Sampler(self._reader, self.interval_s)
        self._sampler.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._edge.window_closed(trainer) and self._sampler is not None:
            self.flush(trainer)

    def flush(self, trainer: pl.Trainer) -> dict[str, float]:
        """Log the means since the last window; returns what was logged."""
        if self._sampler is None:
            return {}
        if self._sampler.error is not None:
            err, self._sampler.error = self._sampler.error, None
            raise RuntimeError(f"GPUMonitor's NVML sampler failed: {err}") from err
        means = self._sampler.take()
        metrics = {f"gpu{dev}/{name}": v for dev, row in means.items() for name, v in row.items()}
        utils = [row["util_pct"] for row in means.values() if "util_pct" in row]
        if utils:
            mean_util = sum(utils) / len(utils)
            metrics["gpu/util_pct_mean"] = mean_util
            self._low_windows = self._low_windows + 1 if mean_util < self.target_util_pct else 0
            if self._low_windows >= self.patience and not self._warned_low:
                self._warned_low = True
                rank_zero_warn(
                    f"GPUMonitor: mean GPU utilisation {mean_util:.0f}% has stayed below {self.target_util_pct:.0f}% "
                    f"for {self._low_windows} windows; see StepTimer's verdict for the cause."
                )
        for key, value in metrics.items():
            self._run_sums[key] = self._run_sums.get(key, 0.0) + value
            self._run_counts[key] = self._run_counts.get(key, 0) + 1
        log_metrics(trainer, metrics)
        return metrics

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler.join(timeout=5 * self.interval_s + 1)
            self.flush(trainer)
            self._sampler = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning does not call Callback.teardown when fit raises (trainer/call.py), so clean up here too.
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._sampler is not None:  # an exception ended fit before on_train_end
            self._sampler.stop()
            self._sampler.join(timeout=5 * self.interval_s + 1)
            self._sampler = None

    @property
    def mean_util_pct(self) -> float | None:
        """Mean utilisation over the run (all windows), ``None`` when nothing was sampled."""
        n = self._run_counts.get("gpu/util_pct_mean")
        return self._run_sums["gpu/util_pct_mean"] / n if n else None

    def summary(self) -> dict[str, Any]:
        """``{"gpu": {"enabled", "util_pct_mean", "low_util_warning", "means": {"gpu0/util_pct": ...}}}``."""
        means = {k: self._run_sums[k] / self._run_counts[k] for k in self._run_sums}
        return {
            "gpu": json_safe(
                {
                    "enabled": self.enabled,
                    "util_pct_mean": self.mean_util_pct,
                    "target_util_pct": self.target_util_pct,
                    "low_util_warning": self._warned_low,
                    "means": means,
                }
            )
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"run_sums": dict(self._run_sums), "run_counts": dict(self._run_counts), "warned_low": self._warned_low}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._run_sums = dict(state_dict["run_sums"])
        self._run_counts = dict(state_dict["run_counts"])
        self._warned_low = bool(state_dict["warned_low"])
