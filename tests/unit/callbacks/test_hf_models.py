"""The callbacks on Hugging Face models a user wrote: tiny ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` from config
objects inside an ordinary LightningModule, dict batches padded to varying lengths (``tests/helpers/hf.py``)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_trainopt.callbacks import ActivationCheckpointing, SpeedMonitor
from tests.helpers.tiny_fit import ListLogger, tiny_trainer
from tests.unit.callbacks._clock import StepClock

pytest.importorskip("transformers")

from tests.helpers.hf import HF_KINDS, hf_batches, hf_module, loader  # noqa: E402


def _executed_flops(kind: str, batch: dict[str, torch.Tensor], checkpointing: bool) -> int:
    """FLOPs that forward + backward of the real module execute on ``batch`` (the mask given), counted by torch.

    Eager attention, so that the counter sees the score products (CPU's fused attention kernel has no FLOP formula
    in torch; the meta copy's attention decomposes into counted matmuls, as eager attention does).
    """
    module = hf_module(kind, attn_implementation="eager")
    module.train()
    if checkpointing:
        module.model.gradient_checkpointing_enable()
    counter = FlopCounterMode(display=False)
    with counter:
        out = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        out.logits.float().sum().backward()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing_enable"])
@pytest.mark.parametrize("kind", HF_KINDS)
def test_speed_monitor_counts_hf_models_fed_padded_masks(kind, checkpointing):
    # Hugging Face's mask code asks whether the padding mask is all ones (and, with the cache off, whether position ids
    # hold packed sequences): a value a meta tensor does not have. Counting must still give the FLOPs the real
    # module executes: model FLOPs for MFU, with gradient_checkpointing_enable() the replayed forward too for HFU.
    batches = hf_batches(3)
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    logger = ListLogger()
    module = hf_module(kind)
    if checkpointing:
        module.model.gradient_checkpointing_enable()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tiny_trainer([clock, monitor], max_steps=3, logger=logger).fit(module, loader(batches))
    assert not [w for w in record if "SpeedMonitor" in str(w.message)]  # no "FLOPs unknown"
    s = monitor.summary()["throughput"]
    assert s["flops_source"] == "torch.utils.flop_counter on a meta copy"
    assert s["flops_fit"]["call"].startswith("forward(input_ids=, attention_mask=)")  # the mask given, not dropped
    model = [_executed_flops(kind, b, checkpointing=False) for b in batches]
    assert logger.values("throughput/mfu") == pytest.approx([f / 1e6 for f in model], rel=1e-9)
    executed = [_executed_flops(kind, b, checkpointing) for b in batches]
    assert logger.values("throughput/hfu") == pytest.approx([f / 1e6 for f in executed], rel=1e-9)
    assert (s["recompute_fraction"] > 0.5) is checkpointing


def _trained(kind: str, batches: list, callbacks: list) -> tuple[torch.Tensor, torch.nn.Module]:
    module = hf_module(kind)
    tiny_trainer(callbacks, max_steps=len(batches)).fit(module, loader(batches))
    return torch.cat([p.detach().flatten() for p in module.parameters()]), module


@pytest.mark.parametrize("kind", HF_KINDS)
def test_activation_checkpointing_trains_padded_hf_batches_as_without_it(kind):
    # With the KV cache on (the models' default), a recomputed forward that appended to the cache again made backward
    # fail on padded batches ("The size of tensor a (8) must match the size of tensor b (4)"); one run without the
    # cache rounds differently from one with it (GPT-2's attention dropout, transformers 5.25), so the cache stays on
    # and the recompute gets an empty one.
    batches = hf_batches(3)
    plain, _ = _trained(kind, batches, [])
    checkpointed, module = _trained(kind, batches, [ActivationCheckpointing()])
    assert torch.equal(checkpointed, plain)
    assert module.model.config.use_cache is True  # the user's setting, untouched


def test_activation_checkpointing_leaves_a_cache_that_is_off_alone(caplog):
    module = hf_module("llama", use_cache=False)
    with caplog.at_level(logging.INFO):
        tiny_trainer([ActivationCheckpointing()], max_steps=1).fit(module, loader(hf_batches(1)))
    assert not [r for r in caplog.records if "use_cache" in r.getMessage()]
    assert module.model.config.use_cache is False
