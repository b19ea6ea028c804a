import pytest

from lightning_trainopt.metrics.step_time import StepSplit, split_marks, step_verdict


def _split(**seconds):
    s = StepSplit(wall=10.0, steps=5)
    for k, v in seconds.items():
        s.add(k, v)
    return s


def test_fractions_add_up_with_other():
    f = _split(data_wait=1.0, forward=3.0, backward=5.0).fractions()
    assert f["data_wait"] == 0.1
    assert f["forward"] == 0.3
    assert f["backward"] == 0.5
    assert abs(f["other"] - 0.1) < 1e-12
    assert "comm" not in f  # not measured, not shown as zero


def test_input_bound_with_concrete_remedies():
    v = step_verdict(_split(data_wait=6.0, forward=2.0, backward=2.0), num_workers=0, pin_memory=False, cpu_count=4)
    assert v.kind == "input-bound"
    assert "60%" in v.reason
    assert "raise data.num_workers from 0 to 4" in v.remedies
    assert any("pin_memory" in r for r in v.remedies)


def test_prefetch_remedy_with_workers():
    v = step_verdict(_split(data_wait=3.0, forward=7.0), num_workers=8, prefetch_factor=2, cpu_count=8)
    assert v.kind == "input-bound"
    assert "raise data.prefetch_factor from 2 to 4" in v.remedies
    assert not any("num_workers" in r for r in v.remedies)


def test_optimizer_comm_compute():
    assert (
        step_verdict(_split(optimizer=4.0, forward=3.0, backward=3.0), offload=True).kind == "optimizer/offload-bound"
    )
    comm = _split(comm=4.0, forward=3.0, backward=3.0)
    # comm not measured: never blamed (its seconds are then in no phase, 40% here, under a raised overhead threshold)
    assert step_verdict(comm, other_threshold=0.5).kind == "compute-bound"
    comm.comm_measured = True
    assert step_verdict(comm).kind == "communication-bound"
    assert step_verdict(_split(forward=4.0, backward=5.0)).kind == "compute-bound"
    assert step_verdict(StepSplit()).kind == "unknown"


def test_split_marks_exact():
    marks = [
        ("batch_end", 0.0),
        ("fetch_start", 0.25),
        ("fetch_end", 0.75),
        ("h2d_start", 1.0),
        ("h2d_end", 1.5),
        ("batch_start", 2.0),
        ("before_backward", 3.0),
        ("after_backward", 5.0),
        ("before_optimizer_step", 5.5),
        ("batch_end", 6.0),
        ("pause", 6.5),
        ("resume", 9.5),
        ("batch_start", 10.0),
    ]
    s = split_marks(marks)
    assert s.seconds["data_wait"] == 0.5  # the fetch only
    assert s.seconds["h2d"] == 0.5
    assert s.seconds["forward"] == 1.0
    assert s.seconds["backward"] == 2.0
    assert s.seconds["optimizer"] == 1.0
    assert s.wall == 7.0  # 10 s less the 3 s validation pause
    assert s.steps == 1
    assert not s.comm_measured
    # The rest of the gaps (0.5 around the fetch before the copy, 0.5 after it, 0.5 + 0.5 around validation) is other.
    assert s.fractions()["other"] == pytest.approx(2.0 / 7.0)


def test_without_a_timed_fetch_the_whole_gap_is_data_wait():
    marks = [
        ("batch_end", 0.0),
        ("h2d_start", 1.0),
        ("h2d_end", 1.5),
        ("batch_start", 2.0),
        ("before_backward", 3.0),
        ("after_backward", 5.0),
        ("before_optimizer_step", 5.5),
        ("batch_end", 6.0),
    ]
    assert split_marks(marks, fetch_timed=False).seconds["data_wait"] == 1.5  # an upper bound, as documented
    assert split_marks(marks).seconds["data_wait"] == 0.0
    assert split_marks(marks).fractions()["other"] == pytest.approx(1.5 / 6.0)


def test_fetch_inside_training_step_is_taken_out_of_forward():
    # A module that takes `dataloader_iter` fetches inside training_step, between batch_start and before_backward.
    marks = [
        ("batch_start", 0.0),
        ("fetch_start", 1.0),
        ("fetch_end", 4.0),
        ("before_backward", 6.0),
        ("after_backward", 8.0),
        ("before_optimizer_step", 8.0),
        ("batch_end", 9.0),
    ]
    s = split_marks(marks)
    assert (s.seconds["data_wait"], s.seconds["forward"], s.seconds["backward"]) == (3.0, 3.0, 2.0)
    assert s.wall == 9.0


def test_time_between_steps_is_overhead_not_input():
    # A checkpoint written between steps: 60% of the time in no phase, 2% fetching.
    split = _split(data_wait=0.2, forward=1.5, backward=2.0, optimizer=0.3)
    v = step_verdict(split, num_workers=0)
    assert v.kind == "overhead-bound"
    assert v.reason.startswith("60% of wall time is outside data, copy, compute and optimizer")
    assert any("every_n_train_steps" in r for r in v.remedies)
    assert step_verdict(split, other_threshold=0.7).kind == "compute-bound"
    # Input stalls still win when both thresholds are crossed.
    assert step_verdict(_split(data_wait=2.0, forward=1.0)).kind == "input-bound"


def test_grads_ready_splits_backward_into_compute_and_exposed_comm():
    # One optimizer step of two micro-batches (accumulation 2): the first runs under no_sync (no reduction, so no
    # grads_ready mark), the second hands its last bucket over at t=13 and backward returns at t=17. Each fetch
    # takes 0.5 s of the 1 s gap before its batch; the other half of each gap is in no phase.
    marks = [
        ("batch_end", 0.0),
        ("fetch_start", 0.25),
        ("fetch_end", 0.75),
        ("batch_start", 1.0),
        ("before_backward", 3.0),
        ("after_backward", 7.0),  # no_sync micro-batch: all 4 s are backward compute
        ("batch_end", 7.0),
        ("fetch_start", 7.5),
        ("fetch_end", 8.0),
        ("batch_start", 8.0),
        ("before_backward", 10.0),
        ("grads_ready", 13.0),
        ("after_backward", 17.0),
        ("before_optimizer_step", 18.0),
        ("batch_end", 20.0),
    ]
    s = split_marks(marks, comm_measured=True)
    assert s.seconds == {"data_wait": 1.0, "h2d": 0.0, "forward": 4.0, "backward": 7.0, "optimizer": 3.0, "comm": 4.0}
    assert s.wall == 20.0
    assert s.steps == 1
    f = s.fractions()
    assert f["comm"] == 0.2
    assert f["backward"] == 0.35
    assert f["other"] == pytest.approx(0.05)
    assert sum(f.values()) == pytest.approx(1.0)
    v = step_verdict(s)
    assert v.kind == "compute-bound"  # 20% < 25%
    assert step_verdict(s, comm_threshold=0.15).kind == "communication-bound"
    assert step_verdict(s, comm_threshold=0.15).reason == "20% of wall time is exposed communication"


def test_comm_measured_zero_is_shown_and_unmeasured_is_absent():
    marks = [("batch_start", 0.0), ("before_backward", 1.0), ("after_backward", 2.0), ("before_optimizer_step", 2.0)]
    assert split_marks(marks, comm_measured=True).fractions()["comm"] == 0.0
    assert "comm" not in split_marks(marks).fractions()


_BF16 = "use bf16 mixed precision (Trainer(precision='bf16-mixed'); train.py: precision=bf16)"
_SDPA = "use fused attention (torch's scaled_dot_product_attention picks flash kernels)"
_COMPILE = "torch.compile the model (torch.compile(model) on the inner model; train.py: compile=true)"
_MICRO = "raise the micro-batch until memory is ~90% used"


@pytest.mark.parametrize(
    ("precision", "compiled", "remedies"),
    [
        ("32-true", False, (_BF16, _SDPA, _COMPILE, _MICRO)),
        ("bf16-mixed", False, (_SDPA, _COMPILE, _MICRO)),
        ("bf16-true", True, (_SDPA, _MICRO)),
        ("16-mixed", False, (_SDPA, _COMPILE, _MICRO)),
        ("32-true", True, (_BF16, _SDPA, _MICRO)),
        (None, None, (_BF16, _SDPA, _COMPILE, _MICRO)),  # unknown: nothing is assumed applied
    ],
)
def test_compute_bound_remedies_leave_out_what_the_run_already_does(precision, compiled, remedies):
    v = step_verdict(_split(forward=4.0, backward=5.0), precision=precision, compiled=compiled)
    assert v.kind == "compute-bound"
    assert v.remedies == remedies
