"""Water-filling and the stagger window on hand-made cases."""

from __future__ import annotations

import pytest

from splitbus.bus.scheduler.stagger import Job, RankLoad, StaggerWindow, water_fill


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


def test_window_closes_when_every_rank_has_work_or_at_the_bound() -> None:
    window: StaggerWindow[str] = StaggerWindow(ranks=4, max_wait_s=0.05)
    assert not window.ready(0.0)
    window.add("a", now=1.0)
    assert not window.ready(1.01) and window.due_at() == 1.05
    assert window.ready(1.05)  # low load: the bound
    window.add("b", 1.05)
    assert window.release() == ["a", "b"] and window.due_at() is None
    for i, item in enumerate("wxyz"):
        window.add(item, 2.0 + i * 0.001)
    assert window.ready(2.003)  # high load: one per rank, no waiting


def test_window_holds_half_a_step_once_the_step_time_is_known() -> None:
    window: StaggerWindow[str] = StaggerWindow(ranks=8, max_wait_s=0.05)
    window.observe_step(0.03)
    window.add("a", now=1.0)
    assert window.due_at() == pytest.approx(1.015)  # half of the group's 30 ms step
    window.observe_step(0.5)  # long prefill steps: the bound caps the wait
    assert window.due_at() == pytest.approx(1.05)
