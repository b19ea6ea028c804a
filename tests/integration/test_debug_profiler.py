"""`python train.py debug=profiler` as a user types it: the preset composes, runs and writes a trace."""

from __future__ import annotations

import json
import subprocess
import sys

from lightning_trainopt.config.validate import validate_config
from tests.helpers.compose import REPO_ROOT, TINY, compose_config

# Only the model and the data are made small: trainer.max_steps and the scheduler's warmup stay the preset's and the
# defaults', so a preset whose run is too short for the default warmup is caught (every run would refuse to start).
_KEPT = ("trainer.max_steps", "scheduler.warmup_steps", "trainer.val_check_interval", "logger")
SMALL = (*(o for o in TINY if not o.startswith(_KEPT)), "data.max_bytes=300000")


def test_preset_fits_the_default_scheduler(tmp_path):
    cfg = compose_config(["debug=profiler"], tmp_path)
    validate_config(cfg)  # the default schedule's warmup fits the preset's run
    schedule = cfg.trainer.profiler.schedule
    assert (schedule.wait, schedule.warmup, schedule.active) == (1, 1, 3)
    assert cfg.trainer.profiler.on_trace_ready._target_ == "torch.profiler.tensorboard_trace_handler"


def test_debug_profiler_runs_and_writes_a_trace(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "debug=profiler", *SMALL, f"hydra.run.dir={tmp_path}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 20
    traces = sorted((tmp_path / "profiler").glob("*.pt.trace.json"))
    assert traces, sorted(p.name for p in (tmp_path / "profiler").iterdir())
    # The training trace holds the three active steps of schedule(wait=1, warmup=1, active=3): steps 2, 3 and 4.
    steps = set()
    for path in traces:
        events = json.loads(path.read_text())["traceEvents"]
        steps |= {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"} <= steps
    table = (tmp_path / "profiler" / "fit-profile.txt").read_text()
    assert "ProfilerStep*" in table
