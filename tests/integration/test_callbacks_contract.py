"""Contract over every callback the package ships: builds, two fits, state round-trip, DDP."""

from __future__ import annotations

import importlib
import io
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_trainopt.callbacks as cbs
from tests.helpers.env import child_env
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer

#: Every callback the package ships, written out rather than read from ``__all__`` (so a callback that drops out of
#: the exports fails here instead of leaving the contract unchecked), with the constructor arguments it needs on CPU.
MIN_KWARGS: dict[str, dict] = {
    "ActivationCheckpointing": {},
    "ActivationCompression": {},
    "ActivationOffload": {},
    "CostMonitor": {},
    "FitReport": {},
    "GPUMonitor": {},
    "MemoryBreakdown": {},
    "MemorySnapshot": {},
    # On CPU the finder needs a byte budget (it refuses to guess one).
    "MicroBatchFinder": {"budget_bytes": 200_000_000},
    "NonFiniteGuard": {},
    "PrecisionReport": {},
    # Checkpoints go to a temporary folder, not the working directory.
    "ResumableCheckpoint": {"dirpath": tempfile.mkdtemp(prefix="contract_ckpt_")},
    "SpeedMonitor": {},
    "StepTimer": {},
    "WarmupCosineLR": {},
}

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _public_callbacks_defined_in_the_package() -> set[str]:
    """The public Callback classes each module of ``callbacks/`` defines, found by importing every module."""
    found = set()
    for info in pkgutil.iter_modules(cbs.__path__):
        module = importlib.import_module(f"{cbs.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, Callback) and obj.__module__ == module.__name__:
                found.add(name)
    return {name for name in found if not name.startswith("_")}


def test_every_callback_is_exported_and_in_the_contract():
    assert sorted(cbs.__all__) == sorted(MIN_KWARGS)
    assert _public_callbacks_defined_in_the_package() == set(MIN_KWARGS)
    assert [name for name in MIN_KWARGS if not issubclass(getattr(cbs, name), Callback)] == []


@pytest.mark.parametrize("name", sorted(MIN_KWARGS))
def test_contract(name):
    cls = getattr(cbs, name)
    cb = cls(**MIN_KWARGS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # monitors that switch off on CPU say so once
        tiny_trainer([cb], max_steps=3).fit(tiny_module(), tiny_data())
        tiny_trainer([cb], max_steps=3).fit(tiny_module(), tiny_data())
    summary = cb.summary()
    assert isinstance(summary, dict)
    json.dumps(summary)  # JSON-safe for metrics.json
    state = cb.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = cls(**MIN_KWARGS[name])
    restored.load_state_dict(torch.load(buffer, weights_only=True))  # plain data: loads from any checkpoint
    assert restored.state_dict() == state


# Offload and compression both replace the saved-tensors hook, so they are refused together (by design): the
# DDP contract runs them in separate fits, which together cover every export.
DDP_GROUPS = [[n for n in MIN_KWARGS if n != "ActivationOffload"], ["ActivationOffload"]]


def _run_ddp(tmp_path, names, strategy="ddp", model="ours"):
    env = child_env(ROOT)
    script = os.path.join(ROOT, "tests", "integration", "_callbacks_ddp_script.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path), ",".join(names), strategy, model],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for data in ranks:
        assert data["global_step"] == 4
        assert data["world_size"] == 2
        assert set(data["summaries"]) == set(names)
    return ranks


@pytest.mark.slow
def test_offload_callback_under_ddp_on_two_cpu_processes(tmp_path):
    ranks = _run_ddp(tmp_path, DDP_GROUPS[1])
    for r in ranks:
        # On CPU there is no device memory to free: the callback says so and switches itself off on every rank.
        assert r["summaries"]["ActivationOffload"]["activation_offload"]["enabled"] is False


@pytest.mark.slow
def test_all_callbacks_under_ddp_on_two_cpu_processes(tmp_path):
    ranks = _run_ddp(tmp_path, DDP_GROUPS[0])
    s0 = ranks[0]["summaries"]
    tp = s0["SpeedMonitor"]["throughput"]
    assert tp["tokens_per_s_total"] == pytest.approx(2 * tp["tokens_per_s"])
    st = s0["StepTimer"]["step_time"]
    # The tiny model's gradient all-reduce is a large share of its step (0.11-0.39 measured): any verdict is honest.
    assert st["verdict"] in (
        "compute-bound",
        "input-bound",
        "optimizer/offload-bound",
        "communication-bound",
        "overhead-bound",
    )
    assert st["comm_measured"] is True  # DDP: StepTimer's comm hook times the exposed all-reduce
    assert s0["MemoryBreakdown"]["memory_breakdown"]["activations"] > 0
    assert s0["CostMonitor"]["cost"]["device_hours"] > 0


@pytest.mark.slow
def test_all_callbacks_on_a_foreign_module_under_ddp(tmp_path):
    # What users do: our callbacks on their own LightningModule (dict batches padded to varying lengths, a pooled
    # head, forward(**inputs) computing its own loss), under DDP. Every callback runs in one fit, checkpointing
    # included, but offload (on CPU it switches off, covered above) and MicroBatchFinder, which needs a batch-size
    # attribute to tune and refuses a module without one (its unit tests cover that error).
    names = [n for n in DDP_GROUPS[0] if n != "MicroBatchFinder"]
    ranks = _run_ddp(tmp_path, names, model="foreign")
    for r in ranks:
        s = r["summaries"]
        tp = s["SpeedMonitor"]["throughput"]
        assert tp["flops_source"] == "torch.utils.flop_counter on a meta copy"
        assert tp["flops_fit"]["call"] == "forward(input_ids=, attention_mask=)"  # never the labels
        assert tp["tflops_per_s"] > 0
        assert tp["tokens_per_s_total"] == pytest.approx(2 * tp["tokens_per_s"])
        ckpt = s["ActivationCheckpointing"]["activation_checkpointing"]
        assert (ckpt["wrapped"], ckpt["candidates"]) == (2, 2)  # the encoder's two layers
        # Both encoder layers recomputed, measured by the counter; embedding lookup and head are not.
        assert 0.5 < tp["recompute_fraction"] < 1
        assert s["MemoryBreakdown"]["memory_breakdown"]["activations"] > 0
        assert s["CostMonitor"]["cost"]["device_hours"] > 0
        assert s["StepTimer"]["step_time"]["comm_measured"] is True
    # The fitted polynomials are a property of the module: the same on every rank, though each rank counted at the
    # length of its own first batch.
    fits = [r["summaries"]["SpeedMonitor"]["throughput"]["flops_fit"] for r in ranks]
    keys = ("per_sequence", "per_token", "per_token_squared", "recomputed", "call")
    assert fits[0]["lengths"] != fits[1]["lengths"]
    assert [f[k] for k in keys for f in fits[:1]] == [f[k] for k in keys for f in fits[1:]]


#: The measuring callbacks and guards; each must work under DeepSpeed and FSDP2 too, not only DDP.
MONITORS = [
    "GPUMonitor",
    "StepTimer",
    "SpeedMonitor",
    "MemoryBreakdown",
    "MemorySnapshot",
    "CostMonitor",
    "WarmupCosineLR",
    "NonFiniteGuard",
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("zero3", marks=RunIf(deepspeed=True)), "fsdp"])
def test_monitors_under_sharded_strategies(tmp_path, strategy):
    from tests.helpers.tiny_fit import TINY

    ranks = _run_ddp(tmp_path, MONITORS, strategy)
    for r in ranks:
        s = r["summaries"]
        tp = s["SpeedMonitor"]["throughput"]
        assert tp["tokens_per_s"] > 0
        assert tp["tokens_per_s_total"] == pytest.approx(2 * tp["tokens_per_s"])
        assert s["StepTimer"]["step_time"]["verdict"] in (
            "compute-bound",
            "input-bound",
            "optimizer/offload-bound",
            "overhead-bound",
        )
        assert s["StepTimer"]["step_time"]["comm_measured"] is False  # measured under DDP only (documented)
        assert s["CostMonitor"]["cost"]["device_hours"] > 0
        mb = s["MemoryBreakdown"]["memory_breakdown"]
        assert mb["activations"] > 0
        # Sharded parameters count by their local shard: half of the fp32 model per rank, to within the padding
        # of odd-sized tensors (the tiny model's are all even: exact).
        assert sum(mb["params"].values()) == pytest.approx(4 * TINY.n_params() / 2, rel=0.01)


def _unsharded(model: str) -> tuple[torch.nn.Module, dict]:
    """The module the script trains as ``model`` (``foreign``, ``hf_llama``, ``hf_gpt2``) and one of its batches."""
    if model == "foreign":
        from tests.unit.callbacks._foreign import DictClassifier, padded_batches

        return DictClassifier(), padded_batches(1)[0]
    from tests.helpers.hf import hf_batches, hf_module

    return hf_module(model.removeprefix("hf_"), use_cache=False), hf_batches(1)[0]  # as ActivationCheckpointing sets


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "model"),
    [pytest.param("zero3", "hf_llama", marks=RunIf(deepspeed=True)), ("fsdp", "hf_gpt2"), ("fsdp", "foreign")],
)
def test_monitors_and_checkpointing_on_user_modules_under_sharded_strategies(tmp_path, strategy, model):
    # A user's LightningModule without configure_model: a transformers model (padded batches, the KV cache on by
    # default) or a plain torch encoder. Under ZeRO-3 the FLOP count on a copy that carried DeepSpeed's hooks crashed
    # both ranks ("IndexError: pop from an empty deque"); FSDP2 refused a module without configure_model.
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    from lightning_trainopt.metrics.flops import fit_seq_flops
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing

    ranks = _run_ddp(tmp_path, [*MONITORS, "ActivationCheckpointing"], strategy, model)
    # What the same module counts unsharded, in this process, with the same blocks checkpointed.
    module, batch = _unsharded(model)
    apply_activation_checkpointing(module, CheckpointPolicy())
    whole = fit_seq_flops(module, batch, samples=4, seq_len=batch["input_ids"].shape[1]).to_dict()
    for r in ranks:
        s = r["summaries"]
        tp = s["SpeedMonitor"]["throughput"]
        assert tp["flops_source"] == "torch.utils.flop_counter on a meta copy"
        assert tp["tflops_per_s"] > 0
        for key in ("per_sequence", "per_token", "per_token_squared", "recomputed"):
            assert tp["flops_fit"][key] == whole[key], key
        assert 0.5 < tp["recompute_fraction"] < 1  # the blocks' replay, measured
        ckpt = s["ActivationCheckpointing"]["activation_checkpointing"]
        assert (ckpt["wrapped"], ckpt["candidates"]) == (2, 2)
        assert s["MemoryBreakdown"]["memory_breakdown"]["activations"] > 0
        assert s["CostMonitor"]["cost"]["device_hours"] > 0
