"""``train.py +strategy=fsdp_tp adapter=lora`` on two "nodes" of 2 processes (two torchrun agents on this machine,
gloo): tensor parallelism inside each node (``strategy.tensor_parallel_size=auto``: a node's processes), FSDP2 across
the nodes, a LoRA adapter; then the same command with a larger ``max_steps`` resumes the run's DCP checkpoint.

The 4-process worker of tests/unit/parallel/test_tp.py checks FSDP2 x TP (and LoRA on it) against one process, cell by
cell; this test checks what a user of ``train.py`` meets on a cluster: the mesh that the default TP size gives and the
figures counted per replica in metrics.json, only the adapters trained on every rank (the frozen base byte for byte,
optimizer state for the adapters only), and the checkpoint every rank wrote read back by a second start.
"""

from __future__ import annotations

import math
import shutil

import pytest

from tests.helpers.torchrun import two_nodes
from tests.integration.test_adapters_app import _check_trained_only_adapters, _probe, _records
from tests.integration.test_resume_mid_epoch import _command, _metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH"),
]

STEPS, LONGER = 4, 6


def test_lora_on_fsdp_tp_over_two_nodes_through_the_app_and_a_longer_resume(tmp_path):
    run = tmp_path / "run"
    args = [*_command(STEPS, STEPS), "+strategy=fsdp_tp", "adapter=lora", "optimizer.lr=0.01", "ckpt_path=auto"]
    two_nodes([*args, *_probe(tmp_path / "first")], run)
    metrics = _metrics(run)
    assert metrics["status"] == "ok"
    assert metrics["strategy"] == "fsdp_tp"
    # TP over each node's 2 processes (the default size), FSDP2 over the 2 nodes.
    assert metrics["parallel_dims"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert (metrics["world_size"], metrics["data_parallel_size"]) == (4, 2)
    # Two replicas read different micro-batches; the two ranks of a TP group read the same ones.
    assert metrics["global_batch_size"] == 2 * metrics["micro_batch_size"]
    assert metrics["tokens_seen"] == STEPS * metrics["global_batch_size"] * metrics["seq_len"]
    # LoRA r=16 on the 7 projections of 2 blocks, counted whole (not one rank's shard): 2 x (4 x 2048 + 3 x 3072)
    assert metrics["trainable_params"] == 34816 < metrics["n_params"] / 2
    assert math.isfinite(metrics["val_loss"])
    for record in _records(tmp_path / "first", 4):
        _check_trained_only_adapters(record, losses_fall=False)

    # The same command, a longer run: every rank reads its part of step STEPS's DCP checkpoint and trains on.
    two_nodes([*args, f"trainer.max_steps={LONGER}"], run)
    resumed = _metrics(run)
    assert resumed["status"] == "ok"
    assert resumed["global_step"] == LONGER
    assert resumed["tokens_this_run"] == (LONGER - STEPS) * metrics["global_batch_size"] * metrics["seq_len"]
    assert math.isfinite(resumed["train_loss"])
