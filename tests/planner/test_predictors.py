"""The arrival predictors (splitbus/planner/predictors.py)."""

from __future__ import annotations

import pytest

from splitbus.planner.predictors import PREDICTORS, Ewma, Last, Peak


def test_every_predictor_starts_at_zero_and_follows_a_constant() -> None:
    assert sorted(PREDICTORS) == ["ewma", "last", "peak"]
    for make in PREDICTORS.values():
        predictor = make()
        assert predictor.predict() == 0
        for _ in range(3):
            predictor.observe(7.0)
        assert predictor.predict() == pytest.approx(7.0)


def test_peak_steps_up_at_once_and_decays_over_intervals() -> None:
    peak, ewma, last = Peak(), Ewma(), Last()
    for predictor in (peak, ewma, last):
        predictor.observe(10)
        predictor.observe(30)
    assert (peak.predict(), last.predict()) == (30, 30)
    assert ewma.predict() == pytest.approx(16)  # 0.3 x 30 + 0.7 x 10
    for _ in range(10):
        peak.observe(30)  # a plateau
    seen = []
    for _ in range(5):
        peak.observe(10)
        seen.append(peak.predict())
    assert seen == sorted(set(seen), reverse=True)  # down a little each interval, not at once
    assert seen[0] > 20 and seen[-1] > 12  # 24, then 10 + 20 x 0.7^5 after five
