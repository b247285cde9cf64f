"""Water-filling and the stagger window on hand-made cases."""

from __future__ import annotations

from dataclasses import fields

import pytest

from splitbus.placement.policies.base import PolicyOptions
from splitbus.placement.stagger import Job, RankLoad, StaggerWindow, group_boundary_s, water_fill
from splitbus.scheduler.config import SchedulerConfig
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines.sim import SimConfig
from tests.placement.windows import busy_window


def _ranks(*loads: int, free: int = 100) -> list[RankLoad]:
    return [RankLoad(f"r{i}", load, free) for i, load in enumerate(loads)]


def test_equal_jobs_spread_one_per_rank() -> None:
    jobs = [Job(f"j{i}", 100, 1) for i in range(4)]
    assert sorted(water_fill(jobs, _ranks(0, 0, 0, 0)).values()) == ["r0", "r1", "r2", "r3"]


def test_jobs_fill_the_lowest_levels_first() -> None:
    # r0 already holds 500 queued tokens: the three jobs level r1..r3 up before touching r0.
    jobs = [Job("a", 300, 1), Job("b", 200, 1), Job("c", 100, 1)]
    assert water_fill(jobs, _ranks(500, 0, 0, 0)) == {"a": "r1", "b": "r2", "c": "r3"}


def test_largest_first_balances_the_levels() -> None:
    jobs = [Job("small1", 10, 1), Job("big", 100, 1), Job("small2", 10, 1), Job("mid", 50, 1)]
    placed = water_fill(jobs, _ranks(0, 0))
    assert placed == {"big": "r0", "mid": "r1", "small1": "r1", "small2": "r1"}  # levels 100 / 70


def test_ties_go_to_the_rank_decoding_least() -> None:
    # No queued prefill anywhere: a batch smaller than the group goes to the ranks with the
    # most free KV blocks (r2 and r0 decode least), not to the first ranks.
    ranks = [RankLoad("r0", 0, 80), RankLoad("r1", 0, 10), RankLoad("r2", 0, 90), RankLoad("r3", 0, 40)]
    assert water_fill([Job("a", 100, 1), Job("b", 50, 1)], ranks) == {"a": "r2", "b": "r0"}


def test_kv_blocks_are_respected() -> None:
    ranks = [RankLoad("r0", 0, 1), RankLoad("r1", 1000, 50)]
    placed = water_fill([Job("needs10", 10, 10), Job("huge", 10, 100)], ranks)
    assert placed == {"needs10": "r1"}  # r0 is emptier but too full of KV; "huge" fits nowhere


def test_when_kv_blocks_run_out_the_lowest_priority_is_left() -> None:
    """Room for two of three jobs: the two of the lower priority values get it, whatever their size."""
    jobs = [Job("big-low", 500, 10, priority=5), Job("small-high", 10, 10, priority=-1), Job("mid", 100, 10)]
    assert water_fill(jobs, [RankLoad("r0", 0, 20)]) == {"small-high": "r0", "mid": "r0"}
    # Within a priority, largest first as before: the big job's level decides the next.
    levels = water_fill([Job("s", 10, 1, priority=1), Job("b", 100, 1, priority=1)], _ranks(0, 50))
    assert levels == {"b": "r0", "s": "r1"}


def test_a_window_releases_by_priority_then_arrival() -> None:
    window = busy_window(0.05, now=1.0)
    window.open(1.0, boundary_at=1.03)
    for item in ("a5", "b0", "c-2", "d0", "e5"):
        window.add(item, 1.0)
    assert window.release(priority=lambda item: int(item[1:])) == ["c-2", "b0", "d0", "a5", "e5"]
    window.open(2.0, boundary_at=2.03)
    for item in ("x1", "y0"):
        window.add(item, 2.0)
    assert window.release() == ["x1", "y0"]  # without a priority: arrival order


def test_window_closes_just_before_the_step_ends_with_every_arrival_of_the_step() -> None:
    window = busy_window(0.05, now=1.0)
    assert not window.ready(0.0) and window.due_at() is None
    window.open(1.0, boundary_at=1.03)
    for i, item in enumerate("abcde"):  # more arrivals than ranks: still one batch, at the boundary
        window.add(item, 1.0 + i / 1000)
    assert not window.ready(1.02) and window.due_at() == pytest.approx(1.03)
    assert window.ready(1.03) and window.release() == ["a", "b", "c", "d", "e"]
    assert window.due_at() is None and not window.ready(2.0)


def test_the_default_bound_waits_out_a_full_prefill_step_of_the_ep_cost_model() -> None:
    """The bound is for a step that overruns its announced end: below a step, it closed the window
    in the middle of every long step (docs/dp.md, "Scheduler side")."""
    full = WorkerConfig.max_prefill_tokens
    assert PolicyOptions().stagger_max_wait_s > SimConfig().group_step_s([("prefill", full)] * 64)
    scheduler = {f.name: f.default for f in fields(SchedulerConfig)}
    assert scheduler["stagger_max_wait_s"] == PolicyOptions().stagger_max_wait_s


def test_window_bound_caps_a_far_boundary() -> None:
    window = busy_window(0.05, now=1.0)
    window.open(1.0, boundary_at=2.0)  # a long prefill step
    window.add("a", 1.0)
    assert window.due_at() == pytest.approx(1.05) and not window.ready(1.04) and window.ready(1.05)


def test_window_of_a_group_that_is_not_stepping_closes_at_once() -> None:
    window: StaggerWindow[str] = StaggerWindow(max_wait_s=0.05)
    window.open(1.0, boundary_at=0.9)  # its last step ended before the arrival
    window.add("b", 1.0)
    assert window.ready(1.0) and window.release() == ["b"]


def test_a_window_that_expects_no_other_arrival_before_the_step_ends_closes_at_once() -> None:
    """A batch of one has nothing to spread: holding it to the step's end only risks its dispatch
    missing the step (docs/dp.md, "Staggered batching")."""
    first: StaggerWindow[str] = StaggerWindow(max_wait_s=0.5)
    first.open(1.0, boundary_at=1.2)  # no arrival seen before: no rate
    first.add("a", 1.0)
    assert first.rate_per_s(1.0) == 0.0 and first.due_at() == 1.0 and first.ready(1.0)
    sparse = busy_window(0.5, now=1.0, rate_per_s=4.0)  # 4/s x 0.2 s = 0.8 expected
    sparse.open(1.0, boundary_at=1.2)
    assert sparse.rate_per_s(1.0) == pytest.approx(4.0) and sparse.due_at() == 1.0
    dense = busy_window(0.5, now=1.0, rate_per_s=6.0)  # 1.2 expected: it holds
    dense.open(1.0, boundary_at=1.2)
    assert dense.due_at() == pytest.approx(1.2)


def test_the_rate_forgets_a_burst_that_ended_long_ago() -> None:
    window = busy_window(0.5, now=1.0, rate_per_s=1000.0)  # a burst up to t = 1 s
    assert window.rate_per_s(1.0) == pytest.approx(1000.0)
    assert window.rate_per_s(11.0) < 2.0  # 16 arrivals over the 10 s since
    window.open(11.0, boundary_at=11.2)
    assert window.due_at() == 11.0


def test_an_empty_window_is_never_ready_and_must_be_opened() -> None:
    window: StaggerWindow[str] = StaggerWindow(max_wait_s=0.05)
    window.open(1.0, boundary_at=0.5)
    assert not window.ready(2.0)  # open, but holds nothing
    window.release()
    with pytest.raises(AssertionError, match="open the window first"):
        window.add("x", 2.0)


def test_group_boundary_is_the_slowest_rank_of_the_first_group_to_finish() -> None:
    assert group_boundary_s({"g0": [1000, 1300, 1100], "g1": [1200, 1250]}) == pytest.approx(1.25)
    # g0 has a rank that never stepped: g0 is not stepping, so there is nothing to wait for.
    assert group_boundary_s({"g0": [1000, 0], "g1": [1200, 1250]}) == 0.0
    assert group_boundary_s({}) == 0.0
