"""``up --autoscale``'s rule (splitbus/cli/autoscale.py ``reconcile``), pure: the planner's advice,
the workers running and draining, and the bounds give what to start and what to drain."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from splitbus.cli.autoscale import Bounds, Drain, Start, reconcile


@dataclass(frozen=True)
class Advice:
    """The fields of the planner's advice ``reconcile`` reads."""

    desired_prefill: int
    desired_decode: int


ONE_TO_THREE = Bounds(1, 3)


def _running(prefill: int, decode: int) -> dict[str, list[str]]:
    """Workers by role, least loaded first: ``p0``, ``p1``... and ``d0``, ``d1``..."""
    return {"prefill": [f"p{i}" for i in range(prefill)], "decode": [f"d{i}" for i in range(decode)]}


def test_no_advice_does_nothing_whatever_the_fleet() -> None:
    assert reconcile(None, _running(0, 9), {}, ONE_TO_THREE) == []


def test_a_rise_starts_every_worker_missing_at_once() -> None:
    actions = reconcile(Advice(3, 2), _running(1, 1), {}, ONE_TO_THREE)
    assert actions == [Start("prefill"), Start("prefill"), Start("decode")]


def test_the_advice_is_clamped_to_the_bounds() -> None:
    assert reconcile(Advice(10, 0), _running(3, 1), {}, ONE_TO_THREE) == []
    assert reconcile(Advice(10, 0), _running(2, 2), {}, ONE_TO_THREE) == [Start("prefill"), Drain("decode", "d0")]
    assert reconcile(Advice(0, 0), _running(0, 0), {}, Bounds(2, 4)) == [Start("prefill")] * 2 + [Start("decode")] * 2


def test_a_fall_drains_one_worker_per_role_at_a_time_the_least_loaded() -> None:
    assert reconcile(Advice(1, 1), _running(3, 3), {}, ONE_TO_THREE) == [Drain("prefill", "p0"), Drain("decode", "d0")]
    # One decode worker is draining still: the next decode drain waits for it to leave.
    assert reconcile(Advice(1, 1), _running(2, 2), {"decode": 1}, ONE_TO_THREE) == [Drain("prefill", "p0")]


def test_a_draining_worker_is_not_counted_so_a_rise_meanwhile_starts_another() -> None:
    assert reconcile(Advice(2, 2), _running(2, 1), {"decode": 1}, ONE_TO_THREE) == [Start("decode")]


@pytest.mark.parametrize("text", ["0:3", "3:2", "1", "a:b", "1:1001", ":"])
def test_bad_bounds_are_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="MIN:MAX"):
        Bounds.parse(text)


def test_bounds_parse() -> None:
    assert Bounds.parse("1:3") == ONE_TO_THREE and Bounds.parse("2:2").clamp(9) == 2
