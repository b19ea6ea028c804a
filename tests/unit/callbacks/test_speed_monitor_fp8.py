"""SpeedMonitor on FP8 runs: MFU against the bf16 dense peak, and the share of the FLOPs in FP8 layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_trainopt.callbacks import SpeedMonitor
from lightning_trainopt.metrics.flops import transformer_flops
from lightning_trainopt.metrics.fp8_flops import fp8_flops_share, fp8_linear_shapes
from tests.helpers.tiny_fit import TINY, ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock


def _fp8_module(**spec_kwargs: object):
    pytest.importorskip("torchao")
    from lightning_trainopt.precision import FP8PrecisionSpec, convert_model

    module = tiny_module()
    module.configure_model()
    spec = FP8PrecisionSpec("fp8", "bf16-mixed", skip_small=False, **spec_kwargs)  # type: ignore[arg-type]
    convert_model(module, spec, emulate=True, fsdp=False)
    return module


def _block_shapes() -> list[tuple[int, int]]:
    d, f = TINY.d_model, TINY.ffn_hidden
    return [(d, d), (d, d), (d, d), (d, d), (f, d), (f, d), (d, f)] * TINY.n_layers


def test_fp8_share_is_logged_and_summarised_exactly():
    module = _fp8_module()
    assert sorted(fp8_linear_shapes(module)) == sorted(_block_shapes())  # every block linear; the head kept bf16
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=1, clock=clock)
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=5, logger=logger)
    trainer.fit(module, tiny_data(batch_size=4, seq_len=16))
    model_flops = transformer_flops(TINY, 16, 4).train
    share = 6 * sum(n * k for n, k in _block_shapes()) * 4 * 16 / model_flops
    assert logger.values("throughput/fp8_flops_share") == [pytest.approx(share)] * 3
    s = monitor.summary()["throughput"]
    assert s["fp8_flops_share"] == pytest.approx(share)
    assert s["fp8_layers"] == 2 * 7
    assert s["peak_dtype"] == "fp32"  # a 32-true run: its own peak; the note says FP8 layers count at it
    assert "FP8 layers" in s["mfu_note"]


def test_without_fp8_layers_the_share_is_zero_and_not_logged():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=2, logger=logger)
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    assert logger.values("throughput/fp8_flops_share") == []
    s = monitor.summary()["throughput"]
    assert s["fp8_flops_share"] == 0.0
    assert s["fp8_layers"] == 0
    assert s["mfu_note"] is None


@pytest.mark.parametrize(("precision", "peak"), [("bf16-mixed", 989.4e12), ("transformer-engine", 989.4e12)])
def test_mfu_is_against_the_bf16_peak_for_mixed_and_fp8_runs(precision, peak):
    # Lightning's transformer-engine precision maps to the fp8 table key; MFU stays against the bf16 dense peak.
    monitor = SpeedMonitor(hardware="h100_sxm")
    trainer = SimpleNamespace(precision=precision, strategy=SimpleNamespace(root_device=torch.device("cuda")))
    monitor.setup(trainer, tiny_module(), "fit")  # type: ignore[arg-type]
    assert monitor._peak == peak
    assert monitor.summary()["throughput"]["peak_dtype"] == "bf16"


def test_fp8_flops_share_arithmetic():
    assert fp8_flops_share(((32, 32),), 10, 6 * 32 * 32 * 10 * 4) == 0.25
    assert fp8_flops_share(((32, 32),), 10, 0) is None
    assert fp8_flops_share(((32, 32),), 10, 1) == 1.0
