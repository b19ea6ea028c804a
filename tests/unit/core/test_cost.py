import pytest

from lightning_trainopt.core.cost import cost_report


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
