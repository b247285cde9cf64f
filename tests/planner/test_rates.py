"""What the planner measures between two readings (splitbus/planner/rates.py): counters' growth
for workers in both, none for a restarted, new or gone worker, backlog growth as arrivals, and no
measurement from a worker that does not report a counter."""

from __future__ import annotations

import pytest

from splitbus.planner.fit import Point
from splitbus.planner.rates import Reading, Sample, sample
from tests.planner.fleet import decoder, prefiller, reading, worker


def _sample(before: Reading, now: Reading) -> Sample:
    got = sample(before, now, min_steps=20)
    assert got is not None
    return got


def test_growth_over_the_interval() -> None:
    got = _sample(reading(0, prefiller(prefills=10, busy_s=1.0)), reading(2, prefiller(prefills=30, busy_s=2.0)))
    assert got.dt_s == 2
    assert got.arrivals_rps == pytest.approx(10)  # 20 prefills in 2 s
    assert got.prompt_tokens == pytest.approx(1000)
    assert (got.prefill_computed_tokens, got.prefill_busy_s) == (20_000, pytest.approx(1.0))


def test_a_restarted_worker_counts_nothing() -> None:
    got = _sample(reading(0, prefiller(prefills=500, busy_s=50)), reading(2, prefiller(prefills=20, busy_s=2)))
    assert got.arrivals_rps == 0
    assert (got.prompt_tokens, got.prefill_computed_tokens, got.prefill_busy_s) == (None, 0, 0)


def test_new_and_gone_workers_count_nothing() -> None:
    before = reading(0, prefiller("p1", prefills=10), prefiller("gone", prefills=10))
    now = reading(2, prefiller("p1", prefills=14), prefiller("new", prefills=50))
    assert _sample(before, now).arrivals_rps == pytest.approx(2)  # p1's 4 only


def test_backlog_growth_adds_to_arrivals() -> None:
    before = reading(0, prefiller(prefills=10, waiting=1), unread=2)
    now = reading(2, prefiller(prefills=14, waiting=3, reserved=2), unread=5, held=1)
    # 4 started, and those not started grew from 3 to 11 (unread, held, waiting, reserved): 12 in 2 s
    assert _sample(before, now).arrivals_rps == pytest.approx(6)


def test_a_shrinking_backlog_never_makes_arrivals_negative() -> None:
    assert _sample(reading(0, prefiller(), unread=100), reading(2, prefiller())).arrivals_rps == 0


def test_an_old_worker_gives_no_sample() -> None:
    old = [worker("p1", prefills_done=10), worker("d1", "decode", decodes_done=10, running=4)]
    now = [worker("p1", prefills_done=20), worker("d1", "decode", decodes_done=20, running=4)]
    got = _sample(reading(0, *old), reading(2, *now))
    assert got.arrivals_rps == pytest.approx(5)  # prefills_done is old: it still counts arrivals
    assert (got.prompt_tokens, got.hit_ratio, got.output_tokens) == (None,) * 3
    assert (got.prefill_computed_tokens, got.prefill_busy_s) == (0, 0)
    assert got.decode_points == ()


def test_decode_points_need_enough_steps() -> None:
    before = reading(0, decoder("d1"), decoder("d2"))
    now = reading(2, decoder("d1", decodes=10, batch=10, itl_s=0.01), decoder("d2", decodes=1, batch=20))
    got = _sample(before, now)
    assert got.decode_points == (Point(pytest.approx(10), pytest.approx(0.01)),)  # d2 ran 10 steps: below 20
    assert got.output_tokens == pytest.approx(200)  # (1990 + 199) / 11 decode tokens, + the first


def test_levels_now_kv_queues_and_held() -> None:
    kv = {"total_kv_blocks": 1000, "free_kv_blocks": 600, "running": 8, "waiting": 1}
    now = reading(
        2, prefiller(queued_prefill_tokens=3000), decoder(reserved=2, **kv), decoder("d2", total_kv_blocks=500)
    )
    got = _sample(reading(0), now)
    assert got.kv_blocks_per_request == pytest.approx(50)  # 400 blocks held by 8
    assert got.decode_kv_blocks == 500
    assert (got.queued_prefill_tokens, got.decode_held) == (3000, 11)
    assert got.decode_running == 8  # waiting and reserved: for their KV, not decoding


def test_the_same_reading_twice_is_no_interval() -> None:
    assert sample(reading(5), reading(5), 20) is None


def test_a_worker_restarted_under_its_id_counts_nothing_then_measures_again() -> None:
    # Kubernetes: the worker is pid 1 in its container, so a restart keeps its id; its counters start from 0
    ran = reading(0, prefiller(prefills=500, busy_s=25), decoder(decodes=500, waiting=3))
    restarted = reading(2, prefiller(prefills=20, busy_s=1), decoder(decodes=20))
    got = _sample(ran, restarted)
    assert (got.arrivals_rps, got.prefill_computed_tokens, got.prefill_busy_s) == (0, 0, 0)  # nothing, none negative
    assert (got.prompt_tokens, got.hit_ratio, got.output_tokens, got.decode_points) == (None, None, None, ())
    again = _sample(restarted, reading(4, prefiller(prefills=40, busy_s=2), decoder(decodes=40)))
    assert again.arrivals_rps == pytest.approx(10)  # 20 prefills in 2 s, counted from the restarted counters
    assert (again.prompt_tokens, again.output_tokens) == (pytest.approx(1000), pytest.approx(200))
    assert (again.prefill_computed_tokens, again.prefill_busy_s) == (20_000, pytest.approx(1.0))
    assert again.decode_points == (Point(pytest.approx(10), pytest.approx(0.01)),)
