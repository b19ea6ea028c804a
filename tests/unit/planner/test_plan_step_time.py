"""plan.py charges the step time of what it chooses: offload, CPU Adam, NVMe and int8 at the hardware's bandwidths,
each overridable; equal prices are ranked by margin; plan.hfu names what the utilisation applies to."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from lightning_trainopt.config.plan import plan, plan_task
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.report import print_plan
from tests.helpers.compose import compose_config

SMALL = ["model=gpt_125m", "hardware=a100_80gb", "precision=bf16", "data.seq_len=1024", "data.batch_size=2"]


def _plan(tmp_path, *overrides):
    return plan(compose_config([*SMALL, *overrides], tmp_path, name="plan"))


@pytest.mark.parametrize(
    ("setup", "override", "item", "moved"),
    [
        # Saved activations out and back for each of the 2 micro-batches, over PCIe (preset: 32 GB/s each way).
        (
            ["activations=offload", "trainer.accumulate_grad_batches=2"],
            ("hardware.pcie_gb_per_s", 32, 8),
            "activation offload",
            lambda e: 2 * e.memory.bytes("activations", "cpu") * 2,
        ),
        # int8 quantise + dequantise: 68 B per bf16 element, elements = stored bytes x 64 / 68 (preset: 2,039 GB/s).
        (
            ["activations=int8"],
            ("hardware.memory_gb_per_s", 2039, 500),
            "int8 activation compression",
            lambda e: e.memory.bytes("activations") * 64 / 68 * 68,
        ),
        # ZeRO-2 offload on 2 ranks of one node: CPU Adam updates both partitions (preset: 1e10 params/s per node).
        (
            ["+strategy=zero2_offload", "trainer.devices=2"],
            ("hardware.cpu_adam_params_per_s", 1e10, 1e8),
            "CPU Adam",
            lambda e: -(-e.inputs.model.n_params() // 2) * 2,
        ),
        # ZeRO-Infinity on 2 ranks: NVMe states written and read once per step, both ranks on the node's drives
        # (preset: 8 GB/s per node); the parameters stay in CPU memory (max_in_cpu).
        (
            ["+strategy=zero_infinity", "trainer.devices=2"],
            ("hardware.nvme_gb_per_s", 8, 2),
            "NVMe swaps",
            lambda e: 2 * (e.memory.bytes("grads", "nvme") + e.memory.bytes("optimizer_states", "nvme")) * 2,
        ),
    ],
)
def test_each_bandwidth_override_changes_the_step_time_as_computed_by_hand(tmp_path, setup, override, item, moved):
    key, preset, given = override
    default = _plan(tmp_path, *setup)
    changed = _plan(tmp_path, *setup, f"{key}={given}")
    unit = 1 if key.endswith("params_per_s") else 1e9
    amount = moved(default.estimate)
    assert amount > 0
    for result, rate in ((default, preset), (changed, given)):
        s = result.estimate.speed
        assert s.overhead.serial[item] == pytest.approx(amount / (rate * unit))
    delta = changed.estimate.speed.step_time_s - default.estimate.speed.step_time_s
    assert delta == pytest.approx(amount / (given * unit) - amount / (preset * unit))
    assert changed.hardware.sources[_SOURCE[key]] == "user-set"


_SOURCE = {
    "hardware.pcie_gb_per_s": "pcie",
    "hardware.memory_gb_per_s": "memory_bandwidth",
    "hardware.nvme_gb_per_s": "nvme",
    "hardware.cpu_adam_params_per_s": "cpu_adam",
}


LLAMA_7B_4096 = [
    "model=llama_7b",
    "hardware=a100_80gb",
    "trainer.devices=4",
    "precision=bf16",
    "data.seq_len=4096",
    "data.batch_size=1",
    "trainer.accumulate_grad_batches=16",
    "plan.search=true",
    "plan.search_space.precision=[bf16]",
    "plan.search_space.strategy=[zero1,zero2,zero3,zero_infinity]",
    "plan.search_space.activations=[none,offload]",
    "plan.search_space.optimizer=[adamw,adamw8bit]",
    "plan.search_space.micro_batch=[1,2]",
    "plan.top_k=50",
]


@pytest.fixture(scope="module")
def llama_7b_search(tmp_path_factory):
    return plan(compose_config(LLAMA_7B_4096, tmp_path_factory.mktemp("plan"), name="plan"))


def test_llama_7b_at_4096_ties_at_the_winners_price_only_where_nothing_is_offloaded_and_by_margin(llama_7b_search):
    rows = llama_7b_search.candidates
    price = rows[0].estimate.speed.usd_per_1b_tokens
    tied = [r for r in rows if r.estimate.speed.usd_per_1b_tokens == pytest.approx(price, rel=1e-12)]
    assert 1 < len(tied) < len(rows)
    # Offloading configurations pay for their copies, CPU Adam and NVMe swaps, so none ties with the winner.
    for r in tied:
        assert r.choices["strategy"] in ("zero1", "zero2", "zero3")
        assert r.choices["activations"] == "none"
        assert r.estimate.speed.step_time_s == pytest.approx(r.estimate.speed.compute_s)
    margins = [r.estimate.margin_bytes for r in tied]
    assert margins == sorted(margins, reverse=True)
    infinity = [r for r in rows if r.choices["strategy"] == "zero_infinity"]
    assert infinity
    for r in infinity:
        o = r.estimate.speed.overhead
        assert o.serial["NVMe swaps"] > 0
        assert o.serial["CPU Adam"] > 0
        assert r.estimate.speed.usd_per_1b_tokens > price


def test_the_search_table_and_json_report_margin_hfu_and_the_step_time(llama_7b_search):
    buf = io.StringIO()
    print_plan(llama_7b_search, console=Console(file=buf, width=400, color_system=None))
    screen = buf.getvalue()
    assert "margin GiB" in screen
    assert "FLOPs x HFU + offload/int8" in screen
    assert "s/step beyond compute" in screen
    rows = json.loads(json.dumps(llama_7b_search.to_dict()))["search"]["top"]
    win = rows[0]
    assert win["hfu"] == 0.4
    # The MFU the plan implies: model FLOPs x tokens/s / peak (no recomputation here, no offload: it equals HFU
    # x model FLOPs / executed FLOPs).
    assert win["mfu"] == pytest.approx(win["model_flops_per_token"] * win["tokens_per_sec_per_device"] / 312e12)
    assert win["step_time"]["compute_s"] == pytest.approx(win["step_time_s"])
    infinity = next(r for r in rows if r["choices"]["strategy"] == "zero_infinity")
    t = infinity["step_time"]
    assert infinity["step_time_s"] == pytest.approx(
        max([t["compute_s"], *t["overlapped_s"].values()]) + sum(t["serial_s"].values())
    )
    assert set(t["formulas"]) >= set(t["serial_s"])


def test_the_screen_prints_each_charge_and_the_rate_with_its_source(tmp_path, capsys):
    plan_task(compose_config([*SMALL, "+strategy=zero2_offload", "trainer.devices=2"], tmp_path, name="plan"))
    out = capsys.readouterr().out
    assert "step = max(compute" in out
    assert "wait, CPU Adam:" in out
    assert "at CPU Adam 1e+10 params/s per node (derived from a measurement" in out
    assert "at PCIe 32 GB/s each way (NVIDIA A100 datasheet" in out
    assert "compute at 40% (plan.hfu, of the FLOPs executed)" in out


def test_plan_mfu_is_refused_with_its_new_name(tmp_path):
    with pytest.raises(ConfigError, match=r"plan\.mfu=0\.5 is invalid: it is now plan\.hfu.*plan\.hfu=0\.5"):
        plan(compose_config([*SMALL, "plan.mfu=0.5"], tmp_path, name="plan"))
    result = _plan(tmp_path, "plan.hfu=0.5")
    assert result.hfu == 0.5
    assert result.estimate.speed.hfu == 0.5
