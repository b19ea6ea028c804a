from lightning_trainopt.core.step_time import StepSplit, step_verdict


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
    assert step_verdict(comm).kind == "compute-bound"  # comm not measured: never blamed
    comm.comm_measured = True
    assert step_verdict(comm).kind == "communication-bound"
    assert step_verdict(_split(forward=4.0, backward=5.0)).kind == "compute-bound"
    assert step_verdict(StepSplit()).kind == "unknown"
