"""Early refusal's predictor as pure functions (splitbus/api/admission.py): the queue ahead, its
share at a request's priority, the measured prefill rate, and the verdict against the deadline."""

from __future__ import annotations

import pytest

from splitbus.api import admission
from splitbus.api.admission import PrefillRates, Refusal, Waiting
from splitbus.bus.records import Reserved, WorkerLoad, counter_growth
from splitbus.bus.registry import WorkerInfo, WorkerRecord


def _worker(
    worker_id: str,
    role: str = "prefill",
    model: str = "m",
    waiting: int = 0,
    done: int = 0,
    reserved: int = 0,
    alive: bool = True,
) -> WorkerInfo:
    load = WorkerLoad(waiting=waiting, prefills_done=done)
    record = WorkerRecord(worker_id=worker_id, role=role, model=model, load=load)
    return WorkerInfo(record, 0, 1000 if alive else -2, Reserved(reserved_requests=reserved))


@pytest.mark.parametrize(
    ("workers", "unread", "ahead"),
    [
        ([], 0, 0),
        ([], 7, 7),
        ([_worker("p", waiting=3, reserved=2)], 1, 6),
        ([_worker("x", role="mixed", waiting=4)], 0, 4),
        ([_worker("d", role="decode", waiting=9)], 0, 0),  # decode workers start nothing
        ([_worker("o", model="other", waiting=9)], 0, 0),  # another model's queue
        ([_worker("dead", waiting=9, alive=False)], 0, 0),
        ([_worker("a", waiting=1), _worker("b", role="mixed", waiting=2, reserved=1)], 3, 7),
    ],
)
def test_the_queue_ahead(workers: list[WorkerInfo], unread: int, ahead: int) -> None:
    assert admission.queued_ahead(workers, "m", unread) == ahead


@pytest.mark.parametrize(
    ("ahead", "mix", "priority", "share"),
    [
        (1000, {}, 0, 1000),  # nothing tracked: every request ahead, as without priorities
        (1000, {0: 95, -1: 5}, -1, 50),  # 5 % at its priority or earlier
        (1000, {0: 95, -1: 5}, 0, 1000),  # the lowest of the mix waits behind all
        (1000, {0: 95, -1: 5}, 3, 1000),  # later than every one tracked: all
        (1000, {0: 95, -1: 5}, -2, 0),  # earlier than every one tracked: none
        (10, {0: 2, 1: 1}, 0, 7),  # 6.67 rounded up: never predicted short by the rounding
        (1, {0: 999, -5: 1}, -5, 1),  # one ahead and a share above nothing: one
        (0, {0: 3}, 0, 0),  # nothing ahead
        (7, {0: 0}, 0, 7),  # an empty count is no mix
    ],
)
def test_the_share_of_the_queue_ahead_at_a_priority(ahead: int, mix: dict[int, int], priority: int, share: int) -> None:
    assert admission.ahead_at(ahead, mix, priority) == share


def test_a_lower_priority_number_never_waits_behind_more() -> None:
    mix = {-3: 4, 0: 17, 2: 9, 10: 1}
    shares = [admission.ahead_at(500, mix, p) for p in range(-5, 12)]
    assert shares == sorted(shares) and shares[0] == 0 and shares[-1] == 500


def test_the_requests_waiting_are_counted_by_priority_and_each_ends_once() -> None:
    waiting = Waiting()
    for request_id, priority in (("a", 0), ("b", 0), ("c", -1), ("a", 0)):  # "a" added twice counts once
        waiting.add(request_id, priority)
    assert (len(waiting), waiting.mix) == (3, {0: 2, -1: 1})
    waiting.started("a")
    waiting.started("a")  # its first result, then its close: counted once
    waiting.started("never-added")  # refused before it was published
    assert (len(waiting), waiting.mix) == (2, {0: 1, -1: 1})
    waiting.started("b")
    waiting.started("c")
    assert (len(waiting), waiting.mix, waiting.priorities) == (0, {}, {})  # no priority left behind at 0


@pytest.mark.parametrize(
    ("before", "now", "done"),
    [
        ({}, {"a": 5}, 0),  # a worker new since counts nothing
        ({"a": 5}, {"a": 9}, 4),
        ({"a": 5, "b": 1}, {"a": 9, "b": 3}, 6),
        ({"a": 50}, {"a": 2}, 0),  # restarted: its counter went back
        ({"a": 5, "gone": 3}, {"a": 6}, 1),
    ],
)
def test_prefills_counted_between_readings(before: dict[str, int], now: dict[str, int], done: int) -> None:
    assert counter_growth(before, now) == done


@pytest.mark.parametrize(
    ("ahead", "rate", "wait"),
    [(0, None, 0.0), (0, 5.0, 0.0), (10, None, None), (10, 0.0, None), (10, 5.0, 2.0), (300, 2.0, 150.0)],
)
def test_the_predicted_wait(ahead: int, rate: float | None, wait: float | None) -> None:
    assert admission.predicted_wait_s(ahead, rate) == wait


@pytest.mark.parametrize(
    ("wait", "deadline", "verdict"),
    [
        (None, 10.0, None),  # no measurement: never refused
        (0.0, 10.0, None),
        (10.0, 10.0, None),
        (10.2, 10.0, Refusal(10.2, 1)),
        (25.0, 10.0, Refusal(25.0, 15)),
        (5000.0, 10.0, Refusal(5000.0, admission.MAX_RETRY_AFTER_S)),
    ],
)
def test_the_verdict(wait: float | None, deadline: float, verdict: Refusal | None) -> None:
    assert admission.judge(wait, deadline) == verdict


def test_the_rate_is_measured_over_busy_windows_with_prefills_and_smoothed() -> None:
    rates = PrefillRates(min_window_s=2.0)
    rates.observe([_worker("a", waiting=5, done=0)], now=0.0)
    assert rates.rate("m") is None  # cold start: one reading measures nothing
    rates.observe([_worker("a", waiting=5, done=100)], now=1.0)
    assert rates.rate("m") is None  # the window is too short: the reading waits
    rates.observe([_worker("a", waiting=5, done=20)], now=2.0)
    assert rates.rate("m") == 10.0  # 20 prefills in 2 s
    rates.observe([_worker("a", waiting=5, done=20)], now=4.0)
    assert rates.rate("m") == 10.0  # a window without prefills says nothing of capacity
    rates.observe([_worker("a", waiting=5, done=60)], now=6.0)
    assert rates.rate("m") == pytest.approx(admission.EWMA_ALPHA * 20 + (1 - admission.EWMA_ALPHA) * 10)
    assert rates.rate("other") is None


def test_a_window_with_nothing_waiting_measures_demand_not_capacity() -> None:
    rates = PrefillRates(min_window_s=1.0)
    rates.observe([_worker("a", done=0)], now=0.0)
    rates.observe([_worker("a", done=2, waiting=3)], now=2.0)
    assert rates.rate("m") is None  # nothing waited at its start: a trickle, not the fleet's pace
    rates.observe([_worker("a", done=4)], now=4.0)
    assert rates.rate("m") is None  # nothing waits at its end
    rates.observe([_worker("a", done=5, reserved=1)], now=6.0)
    rates.observe([_worker("a", done=9, waiting=1)], now=8.0)
    assert rates.rate("m") == 2.0  # requests waited at both ends: 4 in 2 s


def test_a_restarted_worker_does_not_count_its_counter_twice() -> None:
    rates = PrefillRates(min_window_s=1.0)
    rates.observe([_worker("a", waiting=1, done=500), _worker("b", role="mixed", done=0)], now=0.0)
    rates.observe([_worker("a", waiting=1, done=3), _worker("b", role="mixed", done=4)], now=2.0)
    assert rates.rate("m") == 2.0  # b's 4 in 2 s; a went back (restarted) and counts nothing
