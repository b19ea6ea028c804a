import logging
import re

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_trainopt.callbacks.cost_monitor as cost_monitor_module
import lightning_trainopt.callbacks.speed_monitor as speed_monitor_module
from lightning_trainopt.callbacks import CostMonitor, SpeedMonitor
from lightning_trainopt.callbacks.speed_monitor import checkpointed_fraction
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.flops import count_flops, transformer_flops
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import TINY, ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._clock import StepClock
from tests.unit.callbacks._foreign import (
    DictClassifier,
    ObjectBatchClassifier,
    TrimClassifier,
    WholeBatchClassifier,
    loader,
    object_batches,
    padded_batches,
)


def _fit(monitor, clock, max_steps=5, **kwargs):
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=max_steps, logger=logger, **kwargs)
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    return logger


def test_exact_logged_values_with_mocked_clock_and_peak():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=1, clock=clock)
    logger = _fit(monitor, clock)
    flops = transformer_flops(TINY, 16, 4).train
    # Windows close at steps 2 and 4 and at max_steps=5: one micro-batch (2 s), two (4 s), one (2 s); 4 x 16 tokens.
    assert logger.values("throughput/tokens_per_s") == [32.0, 32.0, 32.0]
    assert logger.values("throughput/samples_per_s") == [2.0, 2.0, 2.0]
    assert logger.values("throughput/tflops_per_s") == [flops / 2 / 1e12, 2 * flops / 4 / 1e12, flops / 2 / 1e12]
    assert logger.values("throughput/mfu") == [flops / 2 / 1e6, 2 * flops / 4 / 1e6, flops / 2 / 1e6]
    assert logger.values("throughput/hfu") == logger.values("throughput/mfu")
    s = monitor.summary()["throughput"]
    assert s["tokens"] == 4 * 64
    assert s["samples"] == 4 * 4
    assert s["seconds"] == 8.0
    assert s["tokens_per_s"] == 32.0
    assert s["flops_source"] == "analytic transformer formula"
    assert s["peak_source"] == "user-set (peak_tflops)"


def test_gradient_accumulation_counts_every_micro_batch():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=1, clock=clock)
    logger = _fit(monitor, clock, max_steps=3, accumulate_grad_batches=2)
    # Two micro-batches of 64 tokens per optimizer step, each 2 s: 32 tokens/s, not 16 or 64.
    assert logger.values("throughput/tokens_per_s") == [32.0, 32.0]


def test_variable_length_batches():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    batches = [(torch.randint(0, 64, (4, t)), torch.randint(0, 64, (4, t))) for t in (8, 16, 8, 16)]
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=4, logger=logger)
    trainer.fit(tiny_module(), train_dataloaders=DataLoader(batches, batch_size=None))
    assert logger.values("throughput/tokens_per_s") == [(32 + 64) / 4.0, (32 + 64) / 4.0]
    flops = transformer_flops(TINY, 8, 4).train + transformer_flops(TINY, 16, 4).train
    assert logger.values("throughput/tflops_per_s") == [flops / 4 / 1e12] * 2


def test_no_peak_on_cpu_omits_mfu_with_one_note(caplog):
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, clock=clock)
    logger = _fit(monitor, clock, max_steps=3)
    assert logger.values("throughput/mfu") == []
    assert logger.values("throughput/tokens_per_s") == [64.0, 64.0]
    assert monitor.summary()["throughput"]["mfu"] is None


class Foreign(pl.LightningModule):
    """Not ours: no GPTConfig, so the meta-device flop counter is used."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, x):
        return self.head(self.embed(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_flop_counter_path_for_a_foreign_module():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, clock=clock, warmup_steps=0)
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(Foreign(), tiny_data(batch_size=4, seq_len=16))
    assert monitor.summary()["throughput"]["flops_source"] == "torch.utils.flop_counter on a meta copy"
    forward = 2 * 4 * 16 * 32 * 64
    # backward: the head's weight and input gradients (the embedding needs the latter), 2x forward.
    assert logger.values("throughput/tflops_per_s") == [3 * forward / 1e12] * 2


def test_checkpointed_fraction():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2))
    assert checkpointed_fraction(model, 2) == 0.5
    assert checkpointed_fraction(torch.nn.Linear(2, 2), 2) == 0.0


def test_hfu_counts_the_blocks_our_activation_checkpointing_recomputes():
    from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing

    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    logger = ListLogger()
    trainer = tiny_trainer(
        [ActivationCheckpointing(module_classes=["Block"], every_k=2), clock, monitor], max_steps=2, logger=logger
    )
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    f = transformer_flops(TINY, 16, 4)
    assert monitor.summary()["throughput"]["recompute_fraction"] == 0.5  # 1 of 2 blocks
    assert logger.values("throughput/mfu") == [f.train / 2 / 1e6] * 2
    assert logger.values("throughput/hfu") == [f.hardware_train(0.5) / 2 / 1e6] * 2


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def test_a_foreign_modules_recompute_is_measured_not_counted_as_model_flops():
    # A foreign encoder: the callback wraps 1 of 2 layers. The flop counter sees the wrapped module, so the
    # recomputed forward is counted while counting; it must go to HFU only, and MFU must stay the unwrapped
    # module's FLOPs (counting it into both would overstate MFU and count the recompute twice in HFU).
    from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing

    batches = padded_batches(2)
    clock = StepClock(dt=1.0)
    ckpt = ActivationCheckpointing(module_classes=["TransformerEncoderLayer"], every_k=2)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    logger = ListLogger()
    tiny_trainer([ckpt, clock, monitor], max_steps=2, logger=logger).fit(DictClassifier(), loader(batches))

    plain = [count_flops(DictClassifier(), _inputs(b)) for b in batches]
    wrapped = DictClassifier()
    apply_activation_checkpointing(wrapped, CheckpointPolicy(module_classes=("TransformerEncoderLayer",), every_k=2))
    executed = [count_flops(wrapped, _inputs(b)) for b in batches]
    assert all(e > p for e, p in zip(executed, plain))
    assert logger.values("throughput/tflops_per_s") == pytest.approx([f / 1e12 for f in plain], rel=1e-9)
    assert logger.values("throughput/mfu") == pytest.approx([f / 1e6 for f in plain], rel=1e-9)
    assert logger.values("throughput/hfu") == pytest.approx([f / 1e6 for f in executed], rel=1e-9)
    share = monitor.summary()["throughput"]["recompute_fraction"]
    # Measured: one layer of two, the embedding lookup and the head outside; close to the callback's own
    # weight-share estimate, which leaves out the attention score products.
    assert 0.3 < share < 0.5
    assert share == pytest.approx(ckpt.recomputed_fraction, abs=0.05)


@pytest.mark.parametrize("with_callback", [False, True])
def test_a_module_that_checkpoints_itself_gets_its_measured_recompute(with_callback):
    # gradient_checkpointing_enable() style: no wrapper to find. Our ActivationCheckpointing (if present) wraps
    # nothing; the recompute is still measured from what the module executes.
    from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing
    from lightning_trainopt.metrics.flops import fit_seq_flops
    from tests.unit.callbacks._foreign import SelfCheckpointingClassifier

    batches = padded_batches(2)
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    extra = [ActivationCheckpointing(module_classes=["TransformerEncoderLayer"])] if with_callback else []
    logger = ListLogger()
    model = SelfCheckpointingClassifier()
    if with_callback:
        with pytest.warns(UserWarning, match="already checkpoint themselves"):
            tiny_trainer([*extra, clock, monitor], max_steps=2, logger=logger).fit(model, loader(batches))
    else:
        tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(model, loader(batches))

    plain = [count_flops(DictClassifier(), _inputs(b)) for b in batches]
    executed = [count_flops(SelfCheckpointingClassifier(), _inputs(b)) for b in batches]
    assert logger.values("throughput/mfu") == pytest.approx([f / 1e6 for f in plain], rel=1e-9)
    assert logger.values("throughput/hfu") == pytest.approx([f / 1e6 for f in executed], rel=1e-9)
    b = batches[0]
    fit = fit_seq_flops(SelfCheckpointingClassifier(), b, samples=4, seq_len=b["input_ids"].shape[1])
    assert monitor.summary()["throughput"]["recompute_fraction"] == pytest.approx(float(fit.recompute_share))
    assert 0.5 < fit.recompute_share < 1  # both layers recomputed; embedding and head are not


def test_a_torch_that_cannot_tell_recompute_apart_does_not_count_it_twice(monkeypatch):
    import lightning_trainopt._compat.torch_internals as private
    from tests.unit.callbacks._foreign import SelfCheckpointingClassifier

    monkeypatch.setattr(private, "_count_flops_overridable", lambda: False)
    batches = padded_batches(2)
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(SelfCheckpointingClassifier(), loader(batches))
    executed = [count_flops(SelfCheckpointingClassifier(), _inputs(b)) for b in batches]
    assert logger.values("throughput/mfu") == pytest.approx([f / 1e6 for f in executed], rel=1e-9)
    assert logger.values("throughput/hfu") == logger.values("throughput/mfu")
    s = monitor.summary()["throughput"]
    assert (s["recompute_fraction"], s["flops_note"]) == (
        0.0,
        "this torch cannot tell recomputed FLOPs apart: MFU counts them, HFU equals MFU",
    )


def test_a_given_recompute_fraction_overrides_the_measured_one():
    batches = padded_batches(2)
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_tflops=1e-6, warmup_steps=0, clock=clock, recompute_fraction=0)
    logger = ListLogger()
    from tests.unit.callbacks._foreign import SelfCheckpointingClassifier

    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(SelfCheckpointingClassifier(), loader(batches))
    assert logger.values("throughput/hfu") == logger.values("throughput/mfu")
    assert monitor.summary()["throughput"]["recompute_fraction"] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"peak_tflops": 0}, "callbacks.speed_monitor.peak_tflops=0 is invalid: use a number > 0."),
        ({"peak_tflops": "312"}, "peak_tflops='312' is invalid: use a number > 0 (a number, not a string)."),
        ({"peak_tflops": True}, "peak_tflops=True is invalid"),
        ({"recompute_fraction": 2.0}, "recompute_fraction=2.0 is invalid: use a number >= 0 and <= 1."),
        ({"recompute_fraction": "a"}, "recompute_fraction='a' is invalid"),
        ({"hardware": "h1000"}, "callbacks.speed_monitor.hardware='h1000' is invalid: use auto or one of a100_40gb"),
        ({"hardware": 3}, "hardware=3 is invalid: use a preset name"),
        ({"samples_fn": 3}, "samples_fn=3 is invalid: use a function of the batch"),
        ({"flops_per_batch_fn": "x"}, "flops_per_batch_fn='x' is invalid"),
        ({"warmup_steps": True}, "warmup_steps=True is invalid"),
        ({"log_every_n_steps": "5"}, "log_every_n_steps='5' is invalid"),
    ],
)
def test_bad_arguments_are_refused_in_init(kwargs, message):
    with pytest.raises(ConfigError) as info:
        SpeedMonitor(**kwargs)
    assert message in str(info.value)


def test_good_arguments_are_kept():
    m = SpeedMonitor(hardware="h100", peak_tflops=312, recompute_fraction=0.5, samples_fn=len)
    assert (m.hardware, m.peak_tflops, m.recompute_fraction, m.samples_fn) == ("h100", 312, 0.5, len)


def test_the_mfu_hint_is_an_override_hydra_accepts(caplog):
    from hydra.utils import instantiate

    from tests.helpers.compose import compose_config

    clock = StepClock(dt=1.0)
    with caplog.at_level(logging.INFO):
        _fit(SpeedMonitor(clock=clock), clock, max_steps=1)
    hint = next(r.getMessage() for r in caplog.records if "MFU/HFU omitted" in r.getMessage())
    override = re.search(r"(\+hardware\.peak_tflops\.fp32)=<TFLOP/s>", hint)
    assert override is not None, hint
    cfg = compose_config([f"{override.group(1)}=0.5"])
    assert instantiate(cfg.hardware).peak("fp32") == 0.5e12


@RunIf(min_cuda_gpus=1)
def test_mfu_on_gpu_is_a_true_fraction():
    monitor = SpeedMonitor(log_every_n_steps=2)
    trainer = tiny_trainer([monitor], max_steps=8, accelerator="gpu", precision="bf16-mixed")
    trainer.fit(tiny_module(), tiny_data(batch_size=8, seq_len=16))
    s = monitor.summary()["throughput"]
    assert s["dtype"] == "bf16"
    assert s["peak_tflops"] is not None, "the CUDA device should be in the peak table"
    assert 0.0 < s["mfu"] < 1.0
    assert s["tokens_per_s"] > 0


# --- short runs: the last, partial window is measured -------------------------------------------------------------


def test_a_run_shorter_than_the_logging_window_is_measured():
    clock = StepClock(dt=2.0)
    monitor = SpeedMonitor(clock=clock)  # window: the Trainer's log_every_n_steps=50, more than max_steps
    logger = _fit(monitor, clock, max_steps=6, log_every_n_steps=50)
    # Step 1 is warm-up; steps 2-6 (5 micro-batches, 10 s) close at max_steps.
    assert logger.values("throughput/tokens_per_s") == [32.0]
    s = monitor.summary()["throughput"]
    assert (s["tokens"], s["samples"], s["seconds"], s["tokens_per_s"]) == (5 * 64, 5 * 4, 10.0, 32.0)


def test_an_epoch_based_end_closes_the_window_at_train_end():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(clock=clock)
    logger = _fit(monitor, clock, max_steps=-1, max_epochs=1, limit_train_batches=4, log_every_n_steps=50)
    assert logger.values("throughput/tokens_per_s") == [64.0]  # closed by on_train_end: batches 2-4, 3 s
    s = monitor.summary()["throughput"]
    assert (s["tokens"], s["seconds"]) == (3 * 64, 3.0)


# --- foreign modules: any LightningModule, no arguments -----------------------------------------------------------


def _direct(module: pl.LightningModule, batch: dict) -> int:
    return count_flops(module, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})


def test_foreign_dict_batches_with_padding_labels_and_accumulation(monkeypatch):
    clock = StepClock(dt=1.0)
    # No arguments at all; only the clock is made deterministic.
    monkeypatch.setattr(speed_monitor_module, "default_clock", clock)
    monkeypatch.setattr(cost_monitor_module, "default_clock", clock)
    speed, cost = SpeedMonitor(), CostMonitor()
    batches = padded_batches(8)
    assert len({b["input_ids"].shape[1] for b in batches}) >= 5  # variable padded lengths
    logger = ListLogger()
    module = DictClassifier()
    trainer = tiny_trainer([clock, speed, cost], max_steps=4, accumulate_grad_batches=2, logger=logger)
    with pytest.warns(UserWarning, match="price_per_device_hour"):  # CostMonitor on CPU: no price, hours only
        trainer.fit(module, loader(batches))
    real = [int(b["attention_mask"].sum()) for b in batches]
    assert sum(real) < sum(b["input_ids"].numel() for b in batches)  # padding is not counted
    # Step 1 (micro-batches 0-1) is warm-up; windows close at steps 2, 3, 4, each two micro-batches of 1 s.
    assert logger.values("throughput/tokens_per_s") == [(real[i] + real[i + 1]) / 2 for i in (2, 4, 6)]
    assert logger.values("throughput/samples_per_s") == [4.0, 4.0, 4.0]
    step_flops = [f * 2 * 1e12 for f in logger.values("throughput/tflops_per_s")]
    direct = [_direct(module, batches[i]) + _direct(module, batches[i + 1]) for i in (2, 4, 6)]
    assert step_flops == pytest.approx(direct, rel=1e-9)
    s = speed.summary()["throughput"]
    assert (s["tokens"], s["samples"], s["seconds"]) == (sum(real[2:]), 24, 6.0)
    assert s["flops_source"] == "torch.utils.flop_counter on a meta copy"
    assert s["flops_fit"]["call"] == "forward(input_ids=, attention_mask=)"  # not labels
    c = cost.summary()["cost"]
    assert (c["tokens"], c["samples"]) == (sum(real), 32)  # CostMonitor counts every micro-batch
    assert c["device_hours"] == pytest.approx(8 / 3600)
    assert c["dollars"] is None


def test_flops_are_counted_once_and_never_inside_a_timed_window(monkeypatch):
    clock = StepClock(dt=1.0)
    calls = []
    real_fit = speed_monitor_module.fit_seq_flops

    def slow_fit(*args, **kwargs):
        calls.append(args[3])
        clock.t += 1000.0  # a fit that takes "1000 s" must not show in any window
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(speed_monitor_module, "fit_seq_flops", slow_fit)
    monitor = SpeedMonitor(log_every_n_steps=2, warmup_steps=0, clock=clock)
    batches = padded_batches(6)
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=6, logger=logger).fit(DictClassifier(), loader(batches))
    assert len(calls) == 1  # six batches, several lengths, one count
    real = [int(b["attention_mask"].sum()) for b in batches]
    assert logger.values("throughput/tokens_per_s") == [(real[i] + real[i + 1]) / 2 for i in (0, 2, 4)]


def test_a_forward_that_cannot_run_on_meta_leaves_flops_unknown_and_the_fit_running():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(peak_tflops=1.0, clock=clock)
    logger = ListLogger()
    trainer = tiny_trainer([clock, monitor], max_steps=4, logger=logger)
    with pytest.warns(UserWarning, match="flops_per_batch_fn") as record:
        trainer.fit(TrimClassifier(), loader(padded_batches(4)))
    assert trainer.global_step == 4
    assert sum("FLOPs unknown" in str(w.message) for w in record) == 1  # one warning
    assert "Tensor.item() cannot be called on meta tensors" in next(
        str(w.message) for w in record if "FLOPs unknown" in str(w.message)
    )
    assert len(logger.values("throughput/tokens_per_s")) == 3
    assert logger.values("throughput/tflops_per_s") == []
    assert logger.values("throughput/mfu") == []
    s = monitor.summary()["throughput"]
    assert s["flops_source"] == "unknown"
    assert (s["mfu"], s["hfu"], s["tflops_per_s"], s["flops_per_token"]) == (None, None, None, None)
    assert s["tokens_per_s"] > 0


def test_a_forward_that_takes_the_whole_batch_is_counted():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(clock=clock, warmup_steps=0)
    logger = ListLogger()
    module = WholeBatchClassifier()
    batches = padded_batches(2)
    tiny_trainer([clock, monitor], max_steps=2, logger=logger).fit(module, loader(batches))
    s = monitor.summary()["throughput"]
    assert s["flops_fit"]["call"] == "forward(batch)"
    flops = [f * 1e12 for f in logger.values("throughput/tflops_per_s")]
    assert flops == pytest.approx([count_flops(module, (b,)) for b in batches], rel=1e-9)


def test_a_batch_it_cannot_size_warns_once_and_the_fit_runs():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(clock=clock)
    with pytest.warns(UserWarning, match="cannot size a batch of type Batch") as record:
        tiny_trainer([clock, monitor], max_steps=3).fit(ObjectBatchClassifier(), loader(object_batches(3)))
    messages = [str(w.message) for w in record]
    sizing = [m for m in messages if "cannot size" in m]
    assert len(sizing) == 1
    assert "Pass samples_fn=batch -> int and tokens_fn=batch -> int to SpeedMonitor" in sizing[0]
    assert sum("flops_per_batch_fn" in m for m in messages) == 1
    s = monitor.summary()["throughput"]
    assert (s["tokens"], s["samples"], s["tokens_per_s"]) == (None, None, None)
    assert s["seconds"] == 2.0


def test_user_functions_size_any_batch():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(
        clock=clock,
        samples_fn=lambda b: b.ids.shape[0],
        tokens_fn=lambda b: b.ids.numel(),
        flops_per_batch_fn=lambda b: 1000 * b.ids.numel(),
    )
    logger = ListLogger()
    tiny_trainer([clock, monitor], max_steps=3, logger=logger).fit(ObjectBatchClassifier(), loader(object_batches(3)))
    assert logger.values("throughput/tokens_per_s") == [24.0, 24.0]
    assert logger.values("throughput/tflops_per_s") == [24000 / 1e12, 24000 / 1e12]
    s = monitor.summary()["throughput"]
    assert (s["tokens"], s["samples"], s["flops_source"]) == (48, 8, "flops_per_batch_fn")


@RunIf(min_cuda_gpus=1)
def test_foreign_module_on_gpu_is_counted_on_a_meta_copy():
    monitor = SpeedMonitor(log_every_n_steps=2)
    trainer = tiny_trainer([monitor], max_steps=8, accelerator="gpu", precision="bf16-mixed")
    trainer.fit(DictClassifier(), loader(padded_batches(8)))
    s = monitor.summary()["throughput"]
    assert s["flops_source"] == "torch.utils.flop_counter on a meta copy"
    assert s["peak_tflops"] is not None, "the CUDA device should be in the peak table"
    assert 0.0 < s["mfu"] < 1.0
    assert s["tokens"] == sum(int(b["attention_mask"].sum()) for b in padded_batches(8)[1:])


# --- validation is not training time ------------------------------------------------------------------------------


class ValClock(StepClock):
    """``dt`` seconds per training micro-batch and ``val_dt`` per validation batch (sanity check included)."""

    def __init__(self, dt: float = 1.0, val_dt: float = 10.0) -> None:
        super().__init__(dt)
        self.val_dt = val_dt

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        self.t += self.val_dt


def test_validation_inside_a_window_pauses_its_clock():
    clock = ValClock(dt=1.0, val_dt=10.0)
    monitor = SpeedMonitor(log_every_n_steps=4, peak_tflops=1e-6, warmup_steps=1, clock=clock)
    logger = _fit(monitor, clock, max_steps=9, limit_val_batches=2, val_check_interval=3, num_sanity_val_steps=1)
    # Sanity check (10 s), validation after steps 3 and 6 (20 s each, inside the windows 2-4 and 5-8) and after
    # step 9 are left out: windows of 3, 4 and 1 training seconds at 64 tokens per second.
    assert clock.t == 9 * 1.0 + 10.0 + 3 * 20.0  # the validations did run and take time
    assert logger.values("throughput/tokens_per_s") == [64.0, 64.0, 64.0]
    flops = transformer_flops(TINY, 16, 4).train
    assert logger.values("throughput/mfu") == [flops / 1e6] * 3
    s = monitor.summary()["throughput"]
    assert (s["seconds"], s["tokens"], s["tokens_per_s"], s["samples_per_s"]) == (8.0, 8 * 64, 64.0, 4.0)
    assert s["mfu"] == flops / 1e6


def test_epoch_end_validation_across_a_window_boundary_is_left_out():
    clock = ValClock(dt=1.0, val_dt=10.0)
    monitor = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=0, clock=clock)
    logger = _fit(monitor, clock, max_steps=6, limit_train_batches=3, limit_val_batches=2, max_epochs=-1)
    # Epochs of 3 batches: the window of steps 3-4 spans epoch 0's end-of-epoch validation (20 s).
    assert clock.t == 6 * 1.0 + 2 * 20.0
    assert logger.values("throughput/tokens_per_s") == [64.0, 64.0, 64.0]
    s = monitor.summary()["throughput"]
    assert (s["seconds"], s["tokens"]) == (6.0, 6 * 64)


# --- a second fit, and a resumed one ------------------------------------------------------------------------------


def test_a_second_fit_with_the_same_monitor_is_measured_afresh():
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(peak_tflops=1e-6, warmup_steps=1, clock=clock)
    _fit(monitor, clock, max_steps=4)
    s = monitor.summary()["throughput"]
    assert (s["seconds"], s["tokens"], s["samples"]) == (3.0, 3 * 64, 3 * 4)  # steps 2-4

    trainer = tiny_trainer([clock, monitor], max_steps=4)  # a new Trainer
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    s = monitor.summary()["throughput"]
    assert (s["seconds"], s["tokens"], s["samples"]) == (3.0, 3 * 64, 3 * 4)

    # The same Trainer, fitted again to a higher max_steps: steps 5-8, step 5 its warm-up.
    trainer.fit_loop.epoch_loop.max_steps = 8  # FitLoop.max_steps reads it
    trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    assert trainer.global_step == 8
    s = monitor.summary()["throughput"]
    assert (s["seconds"], s["tokens"], s["samples"]) == (3.0, 3 * 64, 3 * 4)


class _StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(
    ("warmup_steps", "ckpt_step", "accumulate"),
    [
        # After the warm-up (step 1): a closed window (step 2) and an open one (step 3, two micro-batches) are saved.
        (1, 3, 2),
        (3, 2, 1),  # inside the warm-up (steps 1-3): the resumed fit drops step 3 only
    ],
)
def test_a_resumed_fit_reports_what_an_uninterrupted_one_does(tmp_path, warmup_steps, ckpt_step, accumulate):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(stop=None, ckpt_path=None):
        clock = StepClock(dt=1.0)
        monitor = SpeedMonitor(log_every_n_steps=2, peak_tflops=1e-6, warmup_steps=warmup_steps, clock=clock)
        extra = []
        if stop is not None:
            extra = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=stop, save_top_k=-1), _StopAt(stop)]
        logger = ListLogger()
        trainer = tiny_trainer(
            [clock, monitor, *extra],
            max_steps=7,
            logger=logger,
            accumulate_grad_batches=accumulate,
            enable_checkpointing=stop is not None,
        )
        trainer.fit(tiny_module(), tiny_data(batch_size=4, seq_len=16), ckpt_path=ckpt_path)
        return monitor.summary()["throughput"], logger.values("throughput/tokens_per_s")

    whole, whole_logged = run()
    micro = (7 - warmup_steps) * accumulate
    assert (whole["seconds"], whole["tokens"], whole["samples"]) == (float(micro), micro * 64, micro * 4)
    run(stop=ckpt_step)
    (ckpt,) = tmp_path.glob(f"*step={ckpt_step}.ckpt")
    resumed, resumed_logged = run(ckpt_path=str(ckpt))
    keys = ("seconds", "tokens", "samples", "tokens_per_s", "tflops_per_s", "mfu")
    assert {k: resumed[k] for k in keys} == {k: whole[k] for k in keys}
    # The windows the resumed fit closes are the uninterrupted fit's last ones, the carried window included.
    assert resumed_logged == whole_logged[len(whole_logged) - len(resumed_logged) :]
    assert len(resumed_logged) == 3  # windows closing at steps 4, 6 and 7 (max_steps)


def test_the_state_is_plain_data_with_a_device_token_counter(tmp_path):
    import io

    class Grab(pl.Callback):
        state = None

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                Grab.state = monitor.state_dict()

    batches = padded_batches(4)
    clock = StepClock(dt=1.0)
    monitor = SpeedMonitor(log_every_n_steps=2, warmup_steps=1, clock=clock)
    tiny_trainer([clock, monitor, Grab()], max_steps=4).fit(DictClassifier(), loader(batches))
    buf = io.BytesIO()
    torch.save(Grab.state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state == Grab.state
    real = [int(b["attention_mask"].sum()) for b in batches]
    # Step 1 warm-up, window of step 2 closed, step 3 (batch 2) open at save time: its mask sum, an int.
    assert state["totals"]["tokens"] == real[1]
    assert state["window"]["tokens"] == real[2]
    assert type(state["window"]["tokens"]) is int
    assert (state["window"]["seconds"], state["window"]["batches"], state["window"]["samples"]) == (1.0, 1, 4)
    assert state["window"]["flops_known"] is True
    assert state["window"]["model_flops"] > 0
    assert state["start_step"] == 0
    loaded = SpeedMonitor()
    loaded.load_state_dict(state)
    assert loaded.state_dict() == state  # saved again before any fit applies it: nothing is lost


@RunIf(min_cuda_gpus=1)
def test_validation_pause_on_gpu():
    # The CUDA path synchronises at validation start and end; the fake clock keeps the figures exact.
    clock = ValClock(dt=1.0, val_dt=10.0)
    monitor = SpeedMonitor(log_every_n_steps=4, peak_tflops=1e-6, warmup_steps=1, clock=clock)
    logger = _fit(monitor, clock, max_steps=9, limit_val_batches=2, val_check_interval=3, accelerator="gpu")
    assert logger.values("throughput/tokens_per_s") == [64.0, 64.0, 64.0]
    assert monitor.summary()["throughput"]["seconds"] == 8.0


@pytest.mark.parametrize(("max_steps", "timed"), [(1, 1), (2, 1), (3, 2)])
def test_the_default_warmup_leaves_a_step_to_measure(max_steps, timed):
    monitor = SpeedMonitor()
    tiny_trainer([monitor], max_steps=max_steps).fit(tiny_module(), tiny_data())
    throughput = monitor.summary()["throughput"]
    assert throughput["samples"] == timed * 4  # tiny_data's micro-batch: the warm-up step (if any) left out
    assert throughput["seconds"] > 0
