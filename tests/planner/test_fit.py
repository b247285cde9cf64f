"""The decode step time as a line in the batch (splitbus/planner/fit.py)."""

from __future__ import annotations

import pytest

from splitbus.planner.fit import Point, feedback_batch, fit_line, largest_met


def test_the_fit_recovers_the_sims_line() -> None:
    points = [Point(b, 0.004 + 0.0001 * b + noise) for b, noise in [(8, 2e-5), (20, -1e-5), (45, 1e-5), (90, -2e-5)]]
    line = fit_line(points)
    assert line is not None
    assert (line.a, line.c) == (pytest.approx(0.004, abs=5e-5), pytest.approx(0.0001, rel=0.02))
    assert line.batch_at(0.018) in (139, 140, 141)


def test_no_spread_no_fit_and_the_feedback_rule() -> None:
    points = [Point(30, 0.025), Point(32, 0.024)]
    assert fit_line(points) is None  # 32 / 30 < 1.5
    assert feedback_batch(points, itl_slo_s=0.020) == 24  # ⌊30 x 20 / 25⌋: the slowest shrinks in proportion
    assert feedback_batch([Point(30, 0.015)], itl_slo_s=0.020) is None  # meets it: how far it could grow is unknown
    assert feedback_batch([], itl_slo_s=0.020) is None


def test_a_slope_not_positive_is_no_fit() -> None:
    assert fit_line([Point(10, 0.010), Point(40, 0.009)]) is None
    assert fit_line([Point(10, 0.010), Point(40, 0.010)]) is None
    assert fit_line([]) is None


def test_batch_at_a_target_below_the_empty_step_is_none() -> None:
    line = fit_line([Point(10, 0.005), Point(40, 0.008)])
    assert line is not None
    assert line.batch_at(0.003) == 0


def test_the_largest_batch_that_met_the_target() -> None:
    points = [Point(10, 0.010), Point(30, 0.017), Point(40, 0.025)]
    assert largest_met(points, itl_s=0.018) == Point(30, 0.017)  # 40 missed it: 30 is the bound
    assert largest_met([Point(40, 0.025)], itl_s=0.018) is None
    assert largest_met([], itl_s=0.018) is None
