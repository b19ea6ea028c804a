from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_trainopt.callbacks.micro_batch_finder import MicroBatchFinder
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel.spec import StrategySpec, parse_strategy
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer


class BatchSizes(pl.Callback):
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.accumulate: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.sizes.append(int(batch[0].shape[0]))
        self.accumulate.append(trainer.accumulate_grad_batches)


def _zero(stage: int) -> StrategySpec:
    """The spec of a DeepSpeed strategy at ZeRO ``stage``, as a fake strategy carries it (``spec_of`` reads it)."""
    return parse_strategy({"_target_": "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy", "stage": stage})


def _fit(finder: MicroBatchFinder, batch_size: int = 8, accumulate: int = 1, steps: int = 1) -> BatchSizes:
    seen = BatchSizes()
    torch.manual_seed(0)
    trainer = tiny_trainer([finder, seen], max_steps=steps, accumulate_grad_batches=accumulate)
    trainer.fit(tiny_module(), datamodule=tiny_data(batch_size=batch_size))
    assert trainer.global_step == steps
    return seen


def test_budget_picks_micro_batch_and_keeps_global_batch() -> None:
    roomy = MicroBatchFinder(budget_bytes=2**40)
    seen = _fit(roomy)
    assert roomy.plan is not None
    assert roomy.plan.micro_batch == 8
    assert seen.sizes == [8]
    per_sample, fixed = roomy.plan.per_sample_bytes, roomy.plan.fixed_bytes
    assert per_sample > 0
    assert fixed > 0

    tight = MicroBatchFinder(budget_bytes=fixed + 2 * per_sample + per_sample // 2)
    seen = _fit(tight)
    assert tight.plan is not None
    assert (tight.plan.micro_batch, tight.plan.accumulate, tight.plan.global_batch) == (2, 4, 8)
    assert seen.sizes == [2, 2, 2, 2]
    assert seen.accumulate == [4, 4, 4, 4]
    assert tight.summary()["micro_batch_finder"]["global_batch"] == 8


def test_user_accumulation_counts_in_the_global_batch() -> None:
    finder = MicroBatchFinder(budget_bytes=2**40, max_micro_batch=8)
    seen = _fit(finder, batch_size=4, accumulate=4)
    assert finder.plan is not None
    assert (finder.plan.micro_batch, finder.plan.accumulate) == (8, 2)
    assert seen.sizes == [8, 8]


def test_refuses_on_cpu_without_budget() -> None:
    with pytest.raises(ConfigError, match="callbacks.micro_batch_finder.budget_bytes=None") as err:
        _fit(MicroBatchFinder())
    assert "budget_bytes=4e9" in str(err.value)


def test_refuses_when_nothing_fits() -> None:
    with pytest.raises(ConfigError, match="even a micro-batch of 1"):
        _fit(MicroBatchFinder(budget_bytes=1000))


def test_arguments_validated() -> None:
    with pytest.raises(ConfigError, match="budget_fraction"):
        MicroBatchFinder(budget_fraction=1.5)
    with pytest.raises(ConfigError, match="max_micro_batch"):
        MicroBatchFinder(budget_bytes=1, max_micro_batch=0)
    with pytest.raises(ConfigError, match="batch_arg_name"):
        _fit(MicroBatchFinder(budget_bytes=2**40, batch_arg_name="micro"))


@RunIf(min_cuda_gpus=1)
def test_cuda_trials_step_down_on_a_real_out_of_memory() -> None:
    """A budget far above what the allocator may really hand out (capped with set_per_process_memory_fraction) makes
    the plan too big; the trial forward/backward must hit a real ``torch.OutOfMemoryError``, step down through the
    divisors, and train at the largest micro-batch that ran, with the global batch kept."""
    from lightning_trainopt.data.datamodule import TextDataModule
    from lightning_trainopt.models.config import GPTConfig
    from lightning_trainopt.models.lit_gpt import LitGPT

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 4 * 2**30  # ~84 MB saved per sample at 512 x 512 x 4 layers: 512 samples want ~43 GB, 32 fit
    cfg = GPTConfig(name="oom", vocab_size=64, n_layers=4, d_model=512, n_heads=8, ffn_hidden=1408, max_seq_len=512)
    data = TextDataModule(
        corpus="synthetic", seq_len=512, batch_size=512, vocab_size=64, synthetic_tokens=600 * 513, seed=0
    )
    finder = MicroBatchFinder(budget_bytes=total)  # the plan believes the whole device is available
    seen = BatchSizes()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        trainer = tiny_trainer([finder, seen], max_steps=1, accelerator="gpu", devices=1)
        trainer.fit(LitGPT(cfg), datamodule=data)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    assert finder.plan is not None
    fits = [t["fits"] for t in finder.trials]
    assert len(fits) >= 2, finder.trials
    assert fits == [False] * (len(fits) - 1) + [True], finder.trials
    micro = finder.plan.micro_batch
    assert micro == finder.trials[-1]["micro_batch"] < 512
    assert finder.plan.global_batch == 512 == micro * finder.plan.accumulate
    assert set(seen.sizes) == {micro}
    assert len(seen.sizes) == finder.plan.accumulate
    assert trainer.global_step == 1


class _LossOutsideForward(pl.LightningModule):
    """A foreign module whose loss (cross-entropy over a large vocabulary) lives in training_step, not forward."""

    VOCAB = 1000

    def __init__(self, batch_size: int = 6, manual: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.automatic_optimization = not manual
        self.emb = torch.nn.Embedding(self.VOCAB, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, self.VOCAB)
        self.step_bytes: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter

        x, y = batch
        with SavedTensorsCounter(params=self.parameters()) as counter:
            loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())
        self.step_bytes.append((x.shape[0], counter.report().activation_bytes))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        x = torch.randint(0, self.VOCAB, (48, 16), generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(x, x.roll(-1, 1))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_measures_the_real_training_step_with_its_loss_and_precision(precision: str) -> None:
    # Measuring only forward(batch[0]) left out the saved log-softmax over 1000 classes and ran outside autocast.
    finder = MicroBatchFinder(budget_bytes=2**40)
    module = _LossOutsideForward()
    trainer = tiny_trainer([finder], max_steps=1, precision=precision)
    trainer.fit(module)
    assert finder.plan is not None
    micro, real = module.step_bytes[-1]  # the fit loop's own step (the finder's two measurements come first)
    assert micro == finder.plan.micro_batch == 6
    at_1 = module.step_bytes[0][1]
    predicted = at_1 + (micro - 1) * finder.plan.per_sample_bytes
    assert predicted == pytest.approx(real, rel=0.01)
    logged = trainer.callback_metrics
    assert set(logged) == {"loss"}  # the trial steps' self.log calls were silenced, the real one was not


def test_manual_optimisation_needs_forward_fn() -> None:
    with pytest.raises(ConfigError, match="forward_fn"):
        tiny_trainer([MicroBatchFinder(budget_bytes=2**40)], max_steps=1).fit(_LossOutsideForward(manual=True))


def test_forward_fn_replaces_the_training_step() -> None:
    calls: list[int] = []

    def loss_fn(module: pl.LightningModule, batch: Any) -> torch.Tensor:
        calls.append(int(batch[0].shape[0]))
        return module(batch[0]).float().logsumexp(-1).mean()

    finder = MicroBatchFinder(budget_bytes=2**40, forward_fn=loss_fn)
    tiny_trainer([finder], max_steps=1).fit(_LossOutsideForward())
    assert calls == [1, 2]


def test_probe_measures_state_bytes_on_cpu_with_one_copy_per_shape() -> None:
    from lightning_trainopt.callbacks.micro_batch_finder import _probe_state_bytes
    from lightning_trainopt.optim.optimizer_states import optimizer_state_bytes

    module = tiny_module()
    module.configure_model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert _probe_state_bytes(optimizer) == optimizer_state_bytes(optimizer).state_bytes
    made: list[tuple[int, ...]] = []
    real_zeros = torch.zeros

    def counting_zeros(*shape: Any, **kwargs: Any) -> torch.Tensor:
        made.append(tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else tuple(shape))
        assert kwargs.get("device") == "cpu"
        return real_zeros(*shape, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "zeros", counting_zeros)
        _probe_state_bytes(optimizer)
    n_distinct = len({(g_i, tuple(p.shape)) for g_i, g in enumerate(optimizer.param_groups) for p in g["params"]})
    assert len(made) == n_distinct < len(list(module.parameters()))


@RunIf(bnb=True)
def test_probe_matches_a_bitsandbytes_mix_of_8bit_and_fp32_states() -> None:
    from lightning_trainopt.callbacks.micro_batch_finder import _probe_state_bytes
    from lightning_trainopt.optim.optimizer_states import optimizer_state_bytes
    from lightning_trainopt.optim.optimizers import bitsandbytes_optimizer

    layers = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128), torch.nn.Linear(128, 8))
    optimizer = bitsandbytes_optimizer(layers.parameters(), name="AdamW8bit", lr=1e-3, min_8bit_size=4096)
    layers(torch.randn(2, 128)).sum().backward()
    optimizer.step()
    real = optimizer_state_bytes(optimizer)
    assert real.quantised_params
    assert real.full_params
    # Shared per-tensor quantisation maps count once per parameter in the probe: a slight over-estimate only.
    assert real.state_bytes <= _probe_state_bytes(optimizer) <= real.state_bytes * 1.05


def test_ranks_agree_on_the_smallest_choice() -> None:
    from types import SimpleNamespace

    from lightning_trainopt.callbacks.micro_batch_finder import _min_across_ranks

    seen: list[torch.Tensor] = []

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return torch.stack([t, torch.tensor([3])])  # what rank 1 chose

    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(all_gather=all_gather))
    assert _min_across_ranks(trainer, 8, torch.device("cpu")) == 3  # type: ignore[arg-type]
    assert _min_across_ranks(trainer, 2, torch.device("cpu")) == 2  # type: ignore[arg-type]
    assert len(seen) == 2
    single = SimpleNamespace(world_size=1, strategy=None)
    assert _min_across_ranks(single, 8, torch.device("cpu")) == 8  # type: ignore[arg-type]


def test_warns_when_the_global_batch_divides_badly() -> None:
    probe = MicroBatchFinder(budget_bytes=2**40)
    _fit(probe, batch_size=8)
    assert probe.plan is not None
    budget = probe.plan.fixed_bytes + 5 * probe.plan.per_sample_bytes + 1
    finder = MicroBatchFinder(budget_bytes=budget)
    with pytest.warns(UserWarning, match=r"up to 5.*global batches near it that divide well: \[6, 8\]"):
        seen = _fit(finder, batch_size=7)
    assert seen.sizes == [1] * 7


@RunIf(min_cuda_gpus=1)
def test_probe_allocates_nothing_on_the_gpu() -> None:
    # The probe used to build zero copies of every parameter, gradient and state on the device it guards.
    from lightning_trainopt.callbacks.micro_batch_finder import _probe_state_bytes
    from lightning_trainopt.optim.optimizer_states import optimizer_state_bytes

    layers = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    layers(torch.randn(2, 512, device="cuda")).sum().backward()
    optimizer.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert _probe_state_bytes(optimizer) == optimizer_state_bytes(optimizer).state_bytes
    assert torch.cuda.max_memory_allocated() == before


def test_deepspeed_master_partitions_are_not_divided_twice() -> None:
    # ZeRO-1/2 hands the wrapped optimizer this rank's flat fp32 master partition: its state is already a per-rank
    # share (dividing by the world size again halved it), and the master copy itself is optimizer state.
    from types import SimpleNamespace

    layer = torch.nn.Linear(64, 64, bias=False)  # 4096 elements
    partition = torch.zeros(2048, requires_grad=True)  # rank 0's half, as DeepSpeed builds it
    optimizer = torch.optim.AdamW([partition], lr=1e-3)
    engine = SimpleNamespace(basic_optimizer=optimizer)
    trainer = SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=engine, spec=_zero(2)), world_size=2)
    got = MicroBatchFinder(budget_bytes=2**40)._model_state_bytes(trainer, layer)  # type: ignore[arg-type]
    params, grads = 4 * 4096, 4 * 4096 // 2  # ZeRO-2 shards gradients
    states = 8 * 2048 + 4 + 4 * 2048  # two fp32 moments + step, and the fp32 master partition
    assert got == params + grads + states


@pytest.mark.parametrize("finder_first", [False, True])
def test_measures_the_checkpointed_model_whatever_the_callback_order(finder_first: bool) -> None:
    # Listed before ActivationCheckpointing, the finder used to measure the unwrapped model and pick a micro-batch
    # several times too small; it now applies the checkpointing first, once.
    from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing

    def per_sample(order: list[pl.Callback]) -> int:
        finder = next(cb for cb in order if isinstance(cb, MicroBatchFinder))
        torch.manual_seed(0)
        tiny_trainer(order, max_steps=1).fit(tiny_module(), datamodule=tiny_data(batch_size=8))
        assert finder.plan is not None
        return finder.plan.per_sample_bytes

    plain = per_sample([MicroBatchFinder(budget_bytes=2**40)])
    ckpt = ActivationCheckpointing()
    finder = MicroBatchFinder(budget_bytes=2**40)
    checkpointed = per_sample([finder, ckpt] if finder_first else [ckpt, finder])
    assert checkpointed < plain / 2
    assert ckpt.plan is not None
    assert ckpt.summary()["activation_checkpointing"]["wrapped"] == 2  # both tiny blocks, wrapped once


class _Tokens(pl.LightningModule):
    """A module of our users': its own model, loss and DataLoader, no ``batch_size`` attribute of its own."""

    def __init__(self, literal_batch: int | None = None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)
        self.literal_batch = literal_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), x.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randint(0, 16, (32, 4)))
        return torch.utils.data.DataLoader(data, batch_size=self.literal_batch)


class _HparamData(pl.LightningDataModule):
    def __init__(self, micro: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randint(0, 16, (32, 4)))
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.micro)


def _fit_tokens(finder: MicroBatchFinder, module: pl.LightningModule, **fit: Any) -> BatchSizes:
    seen = BatchSizes()
    tiny_trainer([finder, seen], max_steps=1).fit(module, **fit)
    return seen


def test_missing_batch_attribute_says_how_to_expose_a_literal_batch_size() -> None:
    with pytest.raises(ConfigError, match="batch_arg_name='batch_size' is invalid") as err:
        _fit_tokens(MicroBatchFinder(budget_bytes=2**40), _Tokens(literal_batch=8))
    assert "self.batch_size = 16 in __init__ and DataLoader(..., batch_size=self.batch_size)" in str(err.value)


def test_batch_arg_name_can_name_a_datamodule_hparam() -> None:
    probe = MicroBatchFinder(budget_bytes=2**40, batch_arg_name="micro")
    _fit_tokens(probe, _Tokens(), datamodule=_HparamData())
    assert probe.plan is not None
    plan = probe.plan
    finder = MicroBatchFinder(budget_bytes=plan.fixed_bytes + 2 * plan.per_sample_bytes, batch_arg_name="micro")
    data = _HparamData()
    seen = _fit_tokens(finder, _Tokens(), datamodule=data)
    assert data.hparams.micro == 2
    assert seen.sizes == [2, 2, 2, 2]
    assert seen.accumulate == [4, 4, 4, 4]


def test_refuses_a_dataloader_that_ignores_the_batch_attribute() -> None:
    module = _Tokens(literal_batch=8)
    module.batch_size = 8  # present, but train_dataloader() never reads it
    probe = MicroBatchFinder(budget_bytes=2**40)
    _fit_tokens(probe, module)
    assert probe.plan is not None
    plan = probe.plan
    finder = MicroBatchFinder(budget_bytes=plan.fixed_bytes + 2 * plan.per_sample_bytes)
    module = _Tokens(literal_batch=8)
    module.batch_size = 8
    with pytest.raises(
        ConfigError, match="chosen micro-batch 2, but the training DataLoader was built with batch_size=8"
    ):
        _fit_tokens(finder, module)


@pytest.mark.parametrize(
    ("stage", "world", "grads", "states"),
    [
        # A 64 x 64 fp32 weight: 16,384 bytes each of weights and .grad; AdamW: two fp32 moments + a 4-byte step,
        # 32,772 bytes. ZeRO shards optimizer states from stage 1 and gradients only from stage 2.
        (0, 2, 16_384, 32_772),
        (1, 2, 16_384, 32_772 // 2),
        (1, 4, 16_384, 32_772 // 4),
        (2, 4, 16_384 // 4, 32_772 // 4),
    ],
)
def test_zero_stage_and_world_size_shard_states_from_stage_1_and_gradients_from_stage_2(stage, world, grads, states):
    from types import SimpleNamespace

    layer = torch.nn.Linear(64, 64, bias=False)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    trainer = SimpleNamespace(strategy=SimpleNamespace(spec=_zero(stage)), optimizers=[optimizer], world_size=world)
    got = MicroBatchFinder(budget_bytes=2**40)._model_state_bytes(trainer, layer)  # type: ignore[arg-type]
    assert got == 16_384 + grads + states


def test_deepspeed_zero1_master_partitions_keep_whole_gradients():
    # As under ZeRO-2 (test above), the wrapped optimizer steps rank 0's half of the flat fp32 master (2,048
    # elements): its state and the master copy are already per rank. ZeRO-1 does not shard the gradients: all 4,096
    # fp32 elements of .grad stay on every rank.
    from types import SimpleNamespace

    layer = torch.nn.Linear(64, 64, bias=False)
    partition = torch.zeros(2048, requires_grad=True)
    optimizer = torch.optim.AdamW([partition], lr=1e-3)
    engine = SimpleNamespace(basic_optimizer=optimizer)
    trainer = SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=engine, spec=_zero(1)), world_size=2)
    got = MicroBatchFinder(budget_bytes=2**40)._model_state_bytes(trainer, layer)  # type: ignore[arg-type]
    assert got == 4 * 4096 + 4 * 4096 + (8 * 2048 + 4 + 4 * 2048)


def test_zero3_gradient_partitions_are_divided_once():
    # World 2, ZeRO-3: the rank holds half of the 4,096-element fp32 weight (ds_tensor, 8,192 bytes) and a gradient
    # partition of the same size; the wrapped optimizer steps its 2,048-element fp32 master partition (two moments
    # + step, 16,388 bytes, and the master itself, 8,192).
    from types import SimpleNamespace

    layer = torch.nn.Linear(64, 64, bias=False)
    layer.weight.ds_tensor = torch.zeros(2048)
    partition = torch.zeros(2048, requires_grad=True)
    optimizer = torch.optim.AdamW([partition], lr=1e-3)
    engine = SimpleNamespace(basic_optimizer=optimizer)
    trainer = SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=engine, spec=_zero(3)), world_size=2)
    got = MicroBatchFinder(budget_bytes=2**40)._model_state_bytes(trainer, layer)  # type: ignore[arg-type]
    assert got == 4 * 2048 + 4 * 2048 + (8 * 2048 + 4 + 4 * 2048)
