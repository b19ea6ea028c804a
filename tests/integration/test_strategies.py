"""Strategy presets on 2 CPU processes (gloo): resume with the same loss trajectory, and the sharding shows per rank.

Each case runs ``bench/strategies.py --single`` in a subprocess (Lightning's launcher re-executes that script for
rank 1), so pytest itself never forks into a process group. ``--single`` with several presets fits them one after
another in one process group, so a comparison over six presets costs one process start-up per world size.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import child_env
from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "strategies.py"


def _run(tmp_path, name, *args, timeout=240):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(BENCH), *map(str, args), "--out", str(out)]
    proc = subprocess.run(cmd, env=child_env(ROOT), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


RESUME_PRESETS = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp", "fsdp_offload"]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """Every preset fitted for 6 steps with a checkpoint at step 3, then resumed from it: two launches in all.

    Each launch fits the presets in turn in one process group (one process start-up instead of one per preset);
    every fit re-seeds, so each preset's losses are those of a launch of its own. The uninterrupted launch also
    validates at steps 3 and 6 and once more after ``fit`` (validation draws no random numbers and changes no
    weight, so its training losses are those of a run without it). The uninterrupted launch's reports (memory
    breakdown at step 1) and its ZeRO-3 checkpoint serve the sharding and conversion tests too.
    """
    tmp_path = tmp_path_factory.mktemp("resume")
    common = ["--single", *RESUME_PRESETS, "--devices", 2, "--precision", "32-true", "--epoch-batches", 3]
    common += ["--max-steps", 6]
    ckpt = ["--ckpt-dir", tmp_path / "ck" / "{preset}", "--ckpt-every", 3]
    full = _run(tmp_path, "full", *common, *ckpt, "--val-every", 3, timeout=900)
    resumed = _run(tmp_path, "resumed", *common, "--resume", tmp_path / "ck" / "{preset}" / "step3.ckpt", timeout=900)
    return tmp_path / "ck", full, resumed


# Resumed losses must equal the uninterrupted run's. Tolerance 1e-6 (absolute): on CPU in fp32 every kernel and
# every gloo reduction is deterministic, the checkpoint is taken at an epoch boundary (3 batches per epoch) so the
# seeded DistributedSampler replays the same order, and the checkpoint holds the exact fp32 model, optimizer and
# scheduler state; in practice the trajectories are bit-identical.
@pytest.mark.slow
@RunIf(deepspeed=True)
@pytest.mark.parametrize("preset", RESUME_PRESETS)
def test_resume_continues_the_same_loss_trajectory(resume_runs, preset):
    ckpt_root, full, resumed = resume_runs
    ckpt_dir = ckpt_root / preset
    assert (ckpt_dir / "step3.ckpt").exists()
    assert not [p for p in ckpt_dir.iterdir() if ".partial-" in p.name]  # staging paths were committed
    losses = resumed[preset]["losses"]
    assert sorted(losses, key=int) == ["4", "5", "6"]
    for step, loss in losses.items():
        assert abs(loss - full[preset]["losses"][step]) <= 1e-6, (step, loss, full[preset]["losses"][step])


# A validation after fit (train.py's final validation when max_steps is not a multiple of val_check_interval) sets
# the strategy up again: under ZeRO-3 that re-entered deepspeed.zero.Init and re-initialised the trained weights
# (an untrained model's loss), under FSDP2 it applied fully_shard a second time (AssertionError). It must score the
# trained weights exactly as the in-fit validation at the same step did.
@pytest.mark.slow
@RunIf(deepspeed=True)
@pytest.mark.parametrize("preset", RESUME_PRESETS)
def test_a_validation_after_fit_scores_the_trained_weights(resume_runs, preset):
    report = resume_runs[1][preset]
    in_fit = report["val_losses"]
    assert sorted(in_fit, key=int) == ["3", "6"]
    assert in_fit["6"] != in_fit["3"]  # the weights changed between the two validations
    assert report["post_fit_val_loss"] == pytest.approx(in_fit["6"], abs=1e-6)


SHARDING_PRESETS = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
CATEGORIES = ("params", "grads", "optimizer_states")


def _total(mb, cat):
    return sum(mb[cat].values())


# What each preset shards and offloads (rank 0's bytes, 2 processes vs 1; fp32).
SHARDED = {
    "ddp": set(),
    "zero1": {"optimizer_states", "grads"},  # grads: see the ZeRO-1 note in the test
    "zero2": {"optimizer_states", "grads"},
    "zero2_offload": {"optimizer_states", "grads"},
    "zero3": {"optimizer_states", "grads", "params"},
    "zero3_offload": {"optimizer_states", "grads", "params"},
}
ON_CPU = {
    "ddp": set(),
    "zero1": set(),
    "zero2": set(),
    "zero2_offload": {"optimizer_states", "grads"},  # DeepSpeed keeps the gradient partition with the optimizer
    "zero3": set(),
    "zero3_offload": {"optimizer_states", "grads", "params"},
}


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_each_stage_shards_what_it_should_from_one_to_two_processes(tmp_path, resume_runs):
    """1 -> 2 processes, same model, fp32: DDP halves nothing, ZeRO-1/2 the optimizer states and gradients, ZeRO-3
    also the parameters; offload moves optimizer states (and with ZeRO-3 parameters) from device to CPU.

    The 2-process figures are those of the uninterrupted launch of ``resume_runs`` (its memory breakdown is taken at
    optimizer step 1, before its first checkpoint or validation at step 3); one more launch of ``bench/strategies.py``
    fits the six presets in turn on 1 process. Measured
    (bench model, 3,229,952 parameters; rank 0 at optimizer step 1; bytes):

    ======================  ==========================  ==========================  ==========================
    preset                  params 1 -> 2               grads 1 -> 2                optimizer states 1 -> 2
    ======================  ==========================  ==========================  ==========================
    ddp                     12,919,808 -> 12,919,808    12,919,808 -> 12,919,808    25,839,768 -> 25,839,768
    zero1, zero2            12,919,808 -> 12,919,808    12,919,808 ->  6,591,488    38,759,432 -> 19,379,720
    zero2_offload           12,919,808 -> 12,919,808    12,919,808 ->  6,459,904    38,759,424 -> 19,379,712
    zero3                   12,919,808 ->  6,459,904    12,919,808 ->  6,459,904    38,759,428 -> 19,379,716
    zero3_offload           12,919,808 ->  6,459,904    25,839,616 -> 12,919,808    38,759,424 -> 19,379,712
    ======================  ==========================  ==========================  ==========================

    Tolerances, from those figures:

    * "halves": within 0.1% of one half. The exact figures differ from one half by Adam's ``step`` counters, 4-byte
      tensors every rank keeps whole (8 bytes for 2 param groups), and could differ by DeepSpeed's partition padding
      (a flat group is padded to a multiple of the world size; this model's groups need none).
    * ZeRO-1/2 gradients (no offload) exceed one half by 131,584 bytes (2.0%): DeepSpeed sizes its
      ``grads_in_partition`` buffer by the full ``numel`` of every parameter that overlaps this rank's partition
      (stage_1_and_2.py ``copy_grads_in_partition``), so the parameter that straddles the partition boundary is held
      whole: here half of a 256 x 256 matrix (32,768 elements) in the matrix group plus half of a 256-vector
      (128) in the norm group, x 4 bytes. The bound asserted is one largest parameter per group.
    * ZeRO-1 gradients halve too at this point (after backward): with ``overlap_comm`` and
      ``contiguous_gradients`` (Lightning's defaults) stage 1 also reduces gradients in buckets during backward,
      copies its own partition into ``grads_in_partition`` and frees the rest of ``param.grad`` when backward ends;
      until then it holds full gradients (its peak is not halved; ZeRO-2 frees them bucket by bucket).
    """
    one = _run(
        tmp_path, "one", "--single", *SHARDING_PRESETS, "--precision", "32-true", "--max-steps", 2, "--devices", 1
    )
    two = resume_runs[1]
    assert all(two[preset]["devices"] == 2 and two[preset]["precision"] == "32-true" for preset in SHARDING_PRESETS)

    import torch

    from lightning_trainopt.models import GPT, GPTConfig

    cfg = GPTConfig(name="bench", vocab_size=256, n_layers=4, d_model=256, n_heads=4, ffn_hidden=688, max_seq_len=64)
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(cfg).parameters()]
    n = cfg.n_params()
    assert one["ddp"]["n_params"] == n
    # One parameter per group (matrices, vectors) may straddle rank 0's partition boundary.
    straddle_bound = 4 * (max(s.numel() for s in shapes if len(s) == 2) + max(s.numel() for s in shapes if len(s) < 2))

    for preset in SHARDING_PRESETS:
        r1, r2 = one[preset], two[preset]
        expected_stage = None if preset == "ddp" else int(preset[4])
        assert r1["zero_stage"] == r2["zero_stage"] == expected_stage, preset
        m1, m2 = r1["memory_breakdown"], r2["memory_breakdown"]
        for cat in CATEGORIES:
            a, b = _total(m1, cat), _total(m2, cat)
            where = (preset, cat, a, b)
            if cat not in SHARDED[preset]:
                assert b == a, where
            elif preset in ("zero1", "zero2") and cat == "grads":
                assert 0 <= b - a / 2 <= straddle_bound, where
            else:
                assert b == pytest.approx(a / 2, rel=1e-3), where
            for mb in (m1, m2):
                assert mb[cat]["nvme"] == 0, where
                held, empty = ("cpu", "device") if cat in ON_CPU[preset] else ("device", "cpu")
                assert mb[cat][held] > 0, where
                assert mb[cat][empty] == 0, where

    # Unsharded (1 process) bytes/param against the textbook fp32 Adam figure 4 + 4 + 8.
    def per_param(preset, cat):
        return _total(one[preset]["memory_breakdown"], cat) / n

    for preset in SHARDING_PRESETS:
        assert per_param(preset, "params") == 4, preset
        # DeepSpeed keeps its own fp32 master partition even when the weights are fp32: 4 + 8 = 12 B/param.
        assert per_param(preset, "optimizer_states") == pytest.approx(8 if preset == "ddp" else 12, rel=1e-4), preset
        # ZeRO-3 offload holds the gradient partition twice: the compute-dtype buffer the reduction writes into
        # (grad_partitions_flat_buffer) and the fp32 gradient of the CPU master that DeepSpeedCPUAdam reads.
        assert per_param(preset, "grads") == (8 if preset == "zero3_offload" else 4), preset


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_zero3_checkpoint_converts_to_a_plain_gpt_state_dict(tmp_path, resume_runs):
    """The step-3 checkpoint of the ZeRO-3 fit of ``resume_runs`` (2 processes, sharded) converts to one state dict.

    The fit is fp32; DeepSpeed's checkpoint keeps fp32 master partitions under bf16 too, and those are what is read.
    """
    import torch

    from lightning_trainopt.checkpoint.convert import convert_zero_to_fp32
    from lightning_trainopt.models import GPT, GPTConfig

    ckpt_root, full, _ = resume_runs
    report = full["zero3"]
    assert report["zero_stage"] == 3
    assert report["devices"] == 2
    state = convert_zero_to_fp32(ckpt_root / "zero3" / "step3.ckpt", tmp_path / "gpt.pt")
    model = GPT(
        GPTConfig(name="bench", vocab_size=256, n_layers=4, d_model=256, n_heads=4, ffn_hidden=688, max_seq_len=64)
    )
    model.load_state_dict(torch.load(tmp_path / "gpt.pt"), strict=True)
    assert all(t.dtype == torch.float32 for t in state.values())
    assert sum(t.numel() for k, t in state.items() if k != "lm_head.weight") == report["n_params"]
    # Trained from GPT's N(0, 0.02) init (not torch's N(0, 1) embedding default that ZeRO-3 init would leave).
    assert 0.015 < float(state["embed.weight"].detach().std()) < 0.025
