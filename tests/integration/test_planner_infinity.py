"""ZeRO-Infinity's host buffers: the planner's terms against the buffers DeepSpeed really allocates, on 2 CPU processes.

The worker (``_planner_infinity_worker.py``) fits gpt_tiny for 2 steps under ``conf/strategy/zero_infinity.yaml`` with
small parameter swap buffers and reads every buffer from the engine's own objects (numel x element_size); the
planner is run on the same preset node, model and precision. Every figure must match to the byte: the planner
replays DeepSpeed's own 1 KiB I/O alignment, so there is no padding tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_planner_infinity_worker.py")


def _async_io_ok() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return False
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _predicted(precision: str, overrides: list[str]) -> dict[str, int]:
    from lightning_trainopt.config.plan_inputs import strategy_layout
    from lightning_trainopt.models import GPTConfig
    from lightning_trainopt.planner import OPTIMIZER_STATES, estimate_model_states, gpt_param_groups

    conf = ROOT / "lightning_trainopt" / "conf"
    node = OmegaConf.merge(OmegaConf.load(conf / "strategy" / "zero_infinity.yaml"), OmegaConf.from_dotlist(overrides))
    model = OmegaConf.to_container(OmegaConf.load(conf / "model" / "gpt_tiny.yaml"))
    model.pop("_target_")
    trainer_precision = str(OmegaConf.load(conf / "precision" / f"{precision}.yaml").trainer_precision)
    est = estimate_model_states(
        gpt_param_groups(GPTConfig(**model)),
        trainer_precision,
        strategy_layout(node, 2),
        OPTIMIZER_STATES["deepspeed_cpu_adam"],
        2,
    )
    return {t.label: t.nbytes for t in est.terms}


@pytest.mark.slow
@RunIf(deepspeed=True)
@pytest.mark.skipif(not _async_io_ok(), reason="DeepSpeed async_io needs libaio-dev (apt-get install -y libaio-dev)")
@pytest.mark.parametrize(
    ("precision", "extra"),
    [
        # Every partition fits max_in_cpu (Lightning's default 1e9): the weights live in the CPU flat buffers.
        ("bf16", []),
        # 1,000 elements of CPU room: a partial flat buffer, a one-element one, sub-groups on NVMe and the pinned
        # reuse buffer; 5 optimizer swap buffers.
        ("fp32", ["max_in_cpu=1000", "optimizer_buffer_count=5"]),
    ],
)
def test_planned_host_buffers_are_the_ones_deepspeed_allocates(tmp_path, precision, extra):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "measured.json"
    overrides = [f"nvme_path={nvme}", "params_buffer_size=1000000", "params_buffer_count=2", *extra]
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), precision, *overrides],
        cwd=tmp_path,
        env=child_env(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured = json.loads(out.read_text())
    assert measured.pop("device") == "cpu"  # optimizer offload: the half gradient partitions are host memory
    assert measured.pop("swapper count") == 1  # one parameter swapper (zero.Init's), so one set of buffers
    if precision == "fp32":
        # On a CPU process an fp32 gradient's "copy" to the device and to fp32 is the gradient partition itself (no
        # copy is made), so the device term for unswapped fp32 gradients (a real copy on a GPU) has nothing to match.
        measured.pop("fp32 gradients too small or unaligned to swap")
    predicted = _predicted(precision, overrides)
    compared = {}
    for label, nbytes in measured.items():
        match = [p for p in predicted if p.endswith(label)]
        compared[label] = (predicted[match[0]] if match else 0, nbytes)  # the planner drops zero-byte terms
    assert all(p == m for p, m in compared.values()), compared
    assert compared["optimizer swap buffers (pinned)"][1] > 0
    assert compared["parameter swap buffers (pinned)"][1] > 0
    if precision == "fp32":
        assert compared["parameter swap-out reuse buffer (pinned)"][1] > 0
        assert compared["weight partitions beyond max_in_cpu"][1] > 0
