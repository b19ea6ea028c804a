import threading

import pytest
import torch

from lightning_trainopt.callbacks import GPUMonitor
from lightning_trainopt.exceptions import ConfigError
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import ListLogger, tiny_data, tiny_module, tiny_trainer


def _threads():
    return [t for t in threading.enumerate() if t.name == "trainopt-gpu-monitor"]


def test_window_means_from_the_sampler_thread_and_low_util_warning():
    readings = iter([50.0, 70.0] * 10_000)

    def reader():
        return {0: {"util_pct": next(readings), "power_w": 100.0}, 1: {"util_pct": 60.0}}

    monitor = GPUMonitor(interval_s=0.001, log_every_n_steps=1, target_util_pct=85, patience=2, reader=reader)
    logger = ListLogger()
    with pytest.warns(UserWarning, match="below 85%"):
        tiny_trainer([monitor], max_steps=4, logger=logger).fit(tiny_module(), tiny_data())
    power = logger.values("gpu0/power_w")
    assert power
    assert all(p == 100.0 for p in power)
    assert all(50.0 <= u <= 70.0 for u in logger.values("gpu0/util_pct"))
    assert all(u == 60.0 for u in logger.values("gpu1/util_pct"))
    s = monitor.summary()["gpu"]
    assert s["low_util_warning"] is True
    assert 55.0 <= s["util_pct_mean"] <= 65.0
    assert not _threads()  # the sampler stopped with the fit


def test_sampler_error_surfaces_on_the_training_thread():
    def reader():
        raise OSError("driver went away")

    monitor = GPUMonitor(interval_s=0.001, log_every_n_steps=1, reader=reader)
    with pytest.raises(RuntimeError, match="driver went away"):
        tiny_trainer([monitor], max_steps=3).fit(tiny_module(), tiny_data())
    assert not _threads()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_switches_off_on_cpu_with_one_warning():
    monitor = GPUMonitor()
    with pytest.warns(UserWarning, match="GPUMonitor is off"):
        tiny_trainer([monitor], max_steps=2).fit(tiny_module(), tiny_data())
    assert monitor.summary()["gpu"]["enabled"] is False


def test_bad_arguments():
    with pytest.raises(ConfigError, match="target_util_pct"):
        GPUMonitor(target_util_pct=0)
    with pytest.raises(ConfigError, match="interval_s"):
        GPUMonitor(interval_s=-1)


@RunIf(min_cuda_gpus=1, nvml=True)
def test_reads_nvml_on_a_gpu():
    monitor = GPUMonitor(interval_s=0.05, log_every_n_steps=2)
    logger = ListLogger()
    tiny_trainer([monitor], max_steps=20, accelerator="gpu", logger=logger).fit(tiny_module(), tiny_data())
    total = logger.values("gpu0/mem_total_gb")
    assert total
    assert total[0] > 1.0
    assert all(0.0 <= u <= 100.0 for u in logger.values("gpu0/util_pct"))
    assert logger.values("gpu0/sm_clock_mhz")[0] > 0


def test_unresolvable_device_index_switches_the_monitor_off(monkeypatch):
    # CUDA_VISIBLE_DEVICES with MIG instance UUIDs: torch cannot map the ordinal to an NVML index and raises.
    pytest.importorskip("pynvml")
    from types import SimpleNamespace

    from lightning_trainopt._compat import torch_internals as _torch_private

    def unresolvable(ordinal):
        raise RuntimeError("device 0 is not visible (CUDA_VISIBLE_DEVICES=MIG-...)")

    monkeypatch.setattr(_torch_private, "nvml_device_index", unresolvable)
    trainer = SimpleNamespace(
        is_global_zero=True, device_ids=[0], strategy=SimpleNamespace(root_device=torch.device("cuda", 0))
    )
    monitor = GPUMonitor()
    with pytest.warns(UserWarning, match="GPUMonitor is off: NVML cannot start"):
        monitor.setup(trainer, None, "fit")
    assert monitor.enabled is False
