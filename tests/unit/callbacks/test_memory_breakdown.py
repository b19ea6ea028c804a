import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_trainopt.callbacks import MemoryBreakdown
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import measure_saved_tensors
from lightning_trainopt.models.lit_gpt import LitGPT
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import TINY, ListLogger, tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._foreign import TwoOptimizers


def _expected_activations(module, batch_size=4, seq_len=16):
    x = torch.randint(0, 64, (batch_size, seq_len))
    _, report = measure_saved_tensors(lambda b: module.batch_loss(b)[0], (x, x.clone()), params=module.parameters())
    return report.activation_bytes


def test_four_part_table_on_cpu():
    cb = MemoryBreakdown(at_steps=[1])
    module = tiny_module()
    logger = ListLogger()
    tiny_trainer([cb], max_steps=3, logger=logger).fit(module, tiny_data(batch_size=4, seq_len=16))
    row = cb.results[1]
    param_bytes = TINY.n_params() * 4
    assert row["params"] == param_bytes
    assert row["grads"] == param_bytes
    n_tensors = len(list(module.parameters()))
    assert row["optimizer_states"] == 2 * param_bytes + 4 * n_tensors  # AdamW exp_avg, exp_avg_sq, step
    assert row["activations"] == _expected_activations(module) > 0
    assert row["other"] is None
    assert row["peak_memory_bytes"] is None
    s = cb.summary()
    assert s["memory_breakdown"]["activations"] == row["activations"]
    assert s["memory_breakdown"]["step"] == 1
    assert s["memory_breakdown"]["params"] == {"device": param_bytes, "cpu": 0, "nvme": 0}
    assert logger.values("memory/activations_bytes") == [float(row["activations"])]


def test_logged_names_are_the_documented_ones():
    # docs/callbacks.md: memory/{params,grads,optimizer_states,activations,activations_weight_copies,other,
    # peak_memory}_bytes; on CUDA the row's `peak_memory_bytes` was logged as `memory/peak_memory_bytes_bytes`.
    from lightning_trainopt.callbacks.memory_breakdown import _metric_names

    row = {
        "params": 1,
        "grads": 2,
        "optimizer_states": 3,
        "activations": 4,
        "activations_weight_copies": 5,
        "other": 6,
        "peak_memory_bytes": 7,
        "source": "CUDA allocator peak + tensor accounting",
    }
    assert _metric_names(row) == {
        "memory/params_bytes": 1.0,
        "memory/grads_bytes": 2.0,
        "memory/optimizer_states_bytes": 3.0,
        "memory/activations_bytes": 4.0,
        "memory/activations_weight_copies_bytes": 5.0,
        "memory/other_bytes": 6.0,
        "memory/peak_memory_bytes": 7.0,
    }


def test_accumulation_takes_the_largest_micro_batch():
    cb = MemoryBreakdown(at_steps=[0])
    module = tiny_module()
    tiny_trainer([cb], max_steps=1, accumulate_grad_batches=3).fit(module, tiny_data(batch_size=2, seq_len=16))
    assert cb.results[0]["activations"] == _expected_activations(module, batch_size=2)


def test_injected_model_state_fn():
    cb = MemoryBreakdown(
        at_steps=[0], model_state_fn=lambda trainer, module: {"params": 1, "grads": 2, "optimizer_states": 3}
    )
    tiny_trainer([cb], max_steps=1).fit(tiny_module(), tiny_data())
    assert (cb.results[0]["params"], cb.results[0]["grads"], cb.results[0]["optimizer_states"]) == (1, 2, 3)


@RunIf(min_cuda_gpus=1)
def test_allocator_peak_on_gpu():
    cb = MemoryBreakdown(at_steps=[1])
    tiny_trainer([cb], max_steps=2, accelerator="gpu").fit(tiny_module(), tiny_data())
    row = cb.results[1]
    assert row["peak_memory_bytes"] > 0
    known = row["params"] + row["grads"] + row["optimizer_states"] + row["activations"]
    assert row["other"] == row["peak_memory_bytes"] - known
    assert row["activations"] > 0


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4)


def test_a_skipped_step_is_measured_at_the_next_one_and_unreached_steps_warn():
    cb = MemoryBreakdown(at_steps=[1, 3, 40])
    with pytest.warns(
        UserWarning, match=r"optimizer step\(s\) \[40\] .* never reached \(the run ended at global_step 12\)"
    ):
        tiny_trainer([cb], max_steps=12).fit(TwoOptimizers(), _loader())
    assert sorted(cb.results) == [2, 4]  # global_step never equals 1 or 3
    row = cb.results[2]
    assert row["params"] == (8 * 8 + 8 + 8 + 1) * 4
    assert row["optimizer_states"] == 2 * (8 + 1) * 4 + 2 * 4  # AdamW on the head only: exp_avg, exp_avg_sq, step
    assert row["activations"] > 0
    assert cb.summary()["memory_breakdown"]["step"] == 4


def test_one_step_as_an_int_and_a_new_run_measures_again():
    cb = MemoryBreakdown(at_steps=2)
    assert cb.at_steps == [2]
    for _ in range(2):
        cb.results[99] = {"params": 0}  # left over from an earlier run: a new fit starts afresh
        tiny_trainer([cb], max_steps=6).fit(TwoOptimizers(), _loader())
        assert sorted(cb.results) == [2]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"at_steps": "5"}, "at_steps"),
        ({"at_steps": [1.5]}, "at_steps"),
        ({"at_steps": True}, "at_steps"),
        ({"at_steps": []}, "at_steps"),
        ({"at_steps": [-1]}, "at_steps"),
        ({"model_state_fn": "accounted"}, "model_state_fn"),
    ],
)
def test_bad_arguments_are_refused_in_init(kwargs, key):
    with pytest.raises(ConfigError) as err:
        MemoryBreakdown(**kwargs)
    assert err.value.key == f"callbacks.memory_breakdown.{key}"
    assert err.value.value == kwargs[key]


def test_bf16_mixed_reports_the_autocast_weight_copies_inside_activations():
    cb = MemoryBreakdown(at_steps=[0])
    module = tiny_module()
    tiny_trainer([cb], max_steps=1, precision="bf16-mixed").fit(module, tiny_data(batch_size=4, seq_len=16))
    row = cb.results[0]
    # Every Linear weight's bf16 copy (2 B per element), a tied lm_head/embedding weight once; the embedding lookup
    # itself saves no copy.
    weights = {id(m.weight): m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear)}
    linear = sum(weights.values())
    assert row["activations_weight_copies"] == 2 * linear
    assert 0 < row["activations_weight_copies"] < row["activations"]
    assert cb.summary()["memory_breakdown"]["activations_weight_copies"] == 2 * linear


def test_fp32_has_no_weight_copies():
    cb = MemoryBreakdown(at_steps=[0])
    tiny_trainer([cb], max_steps=1).fit(tiny_module(), tiny_data(batch_size=4, seq_len=16))
    assert cb.results[0]["activations_weight_copies"] == 0


class _SkipsFirstBatch(LitGPT):
    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            return None  # a skipped batch: no backward, no optimizer step
        return super().training_step(batch, batch_idx)


def test_a_step_without_backward_is_not_recorded_as_zeros():
    cb = MemoryBreakdown(at_steps=[0])
    module = _SkipsFirstBatch(TINY)
    # Lightning still calls optimizer.step for a None step (global_step 0 -> 1); the next step is measured.
    tiny_trainer([cb], max_steps=2).fit(module, tiny_data(batch_size=4, seq_len=16))
    assert list(cb.results) == [1]
    assert cb.results[1]["activations"] == _expected_activations(module) > 0


class _FrozenBase(pl.LightningModule):
    """LoRA-style: a frozen fp32 base between trained layers, so its bf16 copies are saved for the input gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.base = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        return self.head(self.base(self.inp(batch[0]))).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def test_bf16_mixed_counts_copies_of_frozen_weights_and_oom_advice_leaves_them_out(monkeypatch):
    from lightning_trainopt.callbacks import _oom_advice

    cb = MemoryBreakdown(at_steps=[0])
    tiny_trainer([cb], max_steps=1, precision="bf16-mixed").fit(_FrozenBase(), _loader())
    row = cb.results[0]
    # Both frozen base weights' bf16 copies plus the trained head's; `inp` saves none (its input needs no gradient).
    frozen, head = 2 * (32 * 32), 32 * 1
    assert row["activations_weight_copies"] == 2 * (frozen + head)
    assert row["activations"] > row["activations_weight_copies"]
    # The OOM advice (as MemorySnapshot builds it from this row) halves only the part that scales with the batch.
    monkeypatch.setattr(_oom_advice, "_GIB", 1)  # print bytes, so tiny figures are not rounded to 0.00
    keys = ("params", "grads", "optimizer_states", "activations", "activations_weight_copies")
    lines = _oom_advice.oom_advice({k: row[k] for k in keys}, micro_batch=4)
    per_batch = row["activations"] - 2 * (frozen + head)
    assert any(
        "halve the micro-batch (4 -> 2)" in line and f"about {per_batch / 2:.2f} GiB less" in line for line in lines
    )


@pytest.mark.parametrize(("max_steps", "measured"), [(1, 0), (2, 1), (3, 1)])
def test_the_default_steps_measure_every_run(max_steps, measured):
    cb = MemoryBreakdown()
    module = tiny_module()
    tiny_trainer([cb], max_steps=max_steps).fit(module, tiny_data(batch_size=4, seq_len=16))
    assert list(cb.results) == [measured]
    # Optimizer states are read after the measured step, so step 0 of a 1-step run has them too.
    assert cb.results[measured]["optimizer_states"] > 0


class _PeftGPT(pl.LightningModule):
    """Our tiny GPT with the adapter core's LoRA (peft), its targeted layers in NF4 for ``qlora``: what ``adapter=``
    trains."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        pytest.importorskip("peft")
        from lightning_trainopt.models.gpt import GPT
        from lightning_trainopt.transforms.adapters import AdapterSpec, apply_adapter

        self.model = GPT(TINY)
        self.base_for_plan = [GPT(TINY)]  # a plain copy (outside the module) the planner reads
        targets = ("q_proj", "v_proj", "down_proj")
        apply_adapter(self.model, AdapterSpec(kind=kind, r=4, target_modules=targets, compute_dtype="float32"))

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).float().square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_adapter_rows_match_the_planner_within_5_percent(kind):
    pytest.importorskip("bitsandbytes")
    from lightning_trainopt.metrics.adapter_accounting import ADAPTER_ROWS
    from lightning_trainopt.planner import OPTIMIZER_STATES, StrategyLayout
    from lightning_trainopt.planner.adapter_targets import module_adapter_plan
    from lightning_trainopt.planner.adapters import adapter_model_states

    cb = MemoryBreakdown(at_steps=[1])
    module = _PeftGPT(kind)
    data = DataLoader(TensorDataset(torch.randint(0, 64, (8, 16))), batch_size=4)
    tiny_trainer([cb], max_steps=2).fit(module, data)
    row = cb.results[1]
    plan = module_adapter_plan(module.base_for_plan[0], kind, 4, ["q_proj", "v_proj", "down_proj"])
    planned = adapter_model_states(plan, "32-true", StrategyLayout(), OPTIMIZER_STATES["adamw"], 1)

    def rows(category: str, prefix: str) -> int:
        return sum(
            t.nbytes
            for t in planned.terms
            if t.category == category and t.label.startswith(prefix) and t.phase != "build"
        )

    want = {
        "frozen_base": rows("params", "frozen base: 32-bit"),
        "frozen_base_4bit": rows("params", "frozen base: NF4 4-bit"),
        "frozen_base_4bit_scales": rows("params", "frozen base: NF4 scales"),
        "adapter_params": rows("params", "adapters:"),
        "adapter_grads": rows("grads", "adapters:"),
        "adapter_optimizer_states": rows("optimizer_states", "adapters:"),
    }
    assert set(ADAPTER_ROWS) <= set(row)
    for key, planned_bytes in want.items():
        if kind == "lora" and "4bit" in key:
            assert row[key] == planned_bytes == 0
        else:
            assert row[key] > 0, key
            assert abs(planned_bytes - row[key]) <= 0.05 * row[key], (key, planned_bytes, row[key])
    # The adapters' gradients were read before the step, and are the only gradients.
    assert row["adapter_grads"] == row["grads"]
    assert cb.summary()["memory_breakdown"]["adapter_params"] == row["adapter_params"]
