"""Damping the advised counts (splitbus/planner/hysteresis.py): up at once, down after the window."""

from __future__ import annotations

from splitbus.planner.hysteresis import Stabilizer


def test_flapping_makes_one_change() -> None:
    stable = Stabilizer(window_s=30)
    advised = [stable.settle(t, raw) for t, raw in enumerate([2, 4, 2, 4, 2, 4, 2])]
    assert advised == [2, 4, 4, 4, 4, 4, 4]


def test_down_only_after_the_window_and_to_its_highest() -> None:
    stable = Stabilizer(window_s=30)
    assert stable.settle(0, 6) == 6
    assert stable.settle(10, 3) == 6
    assert stable.settle(20, 2) == 6
    assert stable.settle(30, 2) == 3  # 6 (at 0) left the window; 3 (at 10) is the highest in it
    assert stable.settle(39, 2) == 3
    assert stable.settle(40, 2) == 2  # 3 (at 10) left it too
    assert stable.settle(41, 5) == 5  # up at once


def test_no_window_follows_every_count() -> None:
    stable = Stabilizer(window_s=0)
    assert [stable.settle(t, raw) for t, raw in enumerate([3, 1, 4])] == [3, 1, 4]
