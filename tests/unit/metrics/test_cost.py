import pytest

from lightning_trainopt.metrics.cost import cost_report


def test_dollars_exact():
    r = cost_report(
        elapsed_s=1800,
        devices=8,
        price_per_device_hour=4.8,
        tokens=2_000_000_000,
        steps_done=100,
        steps_total=400,
        idle_fraction=0.25,
    )
    assert r.device_hours == 4.0
    assert r.dollars == pytest.approx(19.2)
    assert r.dollars_per_1b_tokens == pytest.approx(9.6)
    assert r.projected_seconds_left == pytest.approx(5400)
    assert r.projected_total_dollars == pytest.approx(76.8)
    assert r.dollars_lost_idle == pytest.approx(4.8)


def test_token_target_projection_and_no_price():
    r = cost_report(100, 1, None, tokens=1000, tokens_target=3000)
    assert r.projected_seconds_left == 200
    assert r.dollars is None
    assert r.projected_total_dollars is None
    assert r.dollars_per_1b_tokens is None
    assert r.device_hours == pytest.approx(100 / 3600)


def test_bad_values():
    with pytest.raises(ValueError, match="devices"):
        cost_report(1, 0, 1.0, 1)


def test_unknown_tokens_leave_out_per_token_figures_and_the_token_projection():
    r = cost_report(360, 2, 10.0, tokens=None, steps_done=5, steps_total=10, tokens_target=1000, samples=400)
    assert r.dollars == pytest.approx(2.0)
    assert r.device_hours == pytest.approx(0.2)
    assert r.dollars_per_1b_tokens is None
    assert r.projected_seconds_left is None  # the target is in tokens: no projection to the steps instead
    assert r.dollars_per_1m_samples == pytest.approx(2.0 / 400 * 1e6)
    r = cost_report(360, 2, 10.0, tokens=None, steps_done=5, steps_total=10)
    assert r.projected_seconds_left == pytest.approx(360)
    assert r.projected_total_dollars == pytest.approx(4.0)
    assert r.dollars_per_1m_samples is None


def test_earlier_runs_keep_their_device_hours_and_the_projection_uses_the_current_run_only():
    # 1 h on 2 devices (2 device-hours, 50 steps, 2000 tokens), resumed on 4 devices for 30 min (10 steps,
    # 1000 tokens): 2 + 0.5 x 4 = 4 device-hours. The current run does 10 steps in 1800 s: 40 steps left take 7200 s
    # on 4 devices = 8 device-hours more.
    r = cost_report(1800, 4, 10.0, tokens=3000, steps_done=60, steps_total=100, prior_device_hours=2.0, prior_steps=50)
    assert r.device_hours == pytest.approx(4.0)
    assert r.dollars == pytest.approx(40.0)
    assert r.dollars_per_1b_tokens == pytest.approx(40.0 / 3000 * 1e9)
    assert r.projected_seconds_left == pytest.approx(7200.0)
    assert r.projected_total_dollars == pytest.approx(40.0 + 8 * 10.0)
    # Right after the resume nothing is measured yet at the new world size: the restored cost, no projection.
    r = cost_report(0.0, 4, 10.0, tokens=2000, steps_done=50, steps_total=100, prior_device_hours=2.0, prior_steps=50)
    assert (r.device_hours, r.dollars) == (2.0, 20.0)
    assert (r.projected_seconds_left, r.projected_total_dollars) == (None, None)


def test_token_target_projection_uses_the_current_runs_token_rate():
    # 2000 tokens before the resume, 1000 in the current run's 100 s: 2000 tokens to go take 200 s on 1 device.
    r = cost_report(100, 1, 36.0, tokens=3000, tokens_target=5000, prior_device_hours=1.0, prior_tokens=2000)
    assert r.projected_seconds_left == pytest.approx(200.0)
    assert r.dollars == pytest.approx((1.0 + 100 / 3600) * 36.0)
    assert r.projected_total_dollars == pytest.approx(r.dollars + 200 / 3600 * 36.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"prior_device_hours": -1.0}, {"prior_steps": -1}, {"prior_steps": 11}],
)
def test_bad_prior_figures(kwargs):
    with pytest.raises(ValueError, match="prior_"):
        cost_report(10, 1, 1.0, 100, steps_done=10, **kwargs)
