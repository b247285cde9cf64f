"""The planner's arithmetic by hand (docs/planner.md, "Formulas"): prefill by the M/D/1 bound on
utilization, decode by the fitted step time and Little's law, then the whole core on two
readings of a made-up fleet."""

from __future__ import annotations

import dataclasses
import math

import pytest

from splitbus.planner.config import PlannerConfig
from splitbus.planner.core import Planner, Reason
from splitbus.planner.fit import Line
from splitbus.planner.model import Backlog, backlog_workers, decode_count, grouped, kv_batch, prefill_count, utilization
from tests.planner.fleet import decoder, prefiller, reading

BUDGET_S = 0.5 * 0.9
"""A TTFT target of 0.5 s less the 10 % reserve."""


def test_utilization_is_the_target_while_the_wait_leaves_room() -> None:
    assert utilization(0.05, BUDGET_S, 0.8) == 0.8
    assert utilization(0.05, BUDGET_S, 1.0) == pytest.approx(2 * 0.40 / 0.85)  # ρ_max = 2(S − s)/(2S − s)
    assert utilization(0.4, BUDGET_S, 0.8) == pytest.approx(2 * 0.05 / 0.5)  # a long prompt: the SLO bounds it


@pytest.mark.parametrize(("rps", "workers"), [(10, 1), (40, 3), (0, 0)])
def test_prefill_workers_for_the_arrivals(rps: float, workers: int) -> None:
    # 10 req/s x 1000 tokens / (20 000 tok/s x 0.8) = 0.625 -> 1; 40 req/s: 2.5 -> 3
    count = prefill_count(rps, 1000, 20_000, BUDGET_S, 0.8, Backlog(0))
    assert (count.workers, count.reason) == (workers, Reason.SLO)


def test_a_prompt_longer_than_the_budget_is_unreachable() -> None:
    count = prefill_count(10, 10_000, 20_000, BUDGET_S, 0.8, Backlog(0))  # s = 0.5 s >= S = 0.45 s
    assert count.reason is Reason.SLO_UNREACHABLE
    assert "0.500 s of a 0.450 s budget" in count.why


def test_the_backlog_beats_the_rate_when_it_needs_more() -> None:
    # workers that come at once: (10 000 tok/s + 30 000 tokens queued / 0.45 s) / 20 000 tok/s = 3.8 -> 4 > the rate's 1
    count = prefill_count(10, 1000, 20_000, BUDGET_S, 0.8, Backlog(30_000))
    assert (count.workers, count.reason) == (4, Reason.BACKLOG)


def test_a_backlog_the_serving_workers_clear_before_a_new_one_comes_gets_none() -> None:
    # 100 000 tokens queued; 1 worker serving 20 000 tok/s against 10 000 arriving clears them in 10 s < 30 s
    assert backlog_workers(10_000, 20_000, BUDGET_S, Backlog(100_000, serving=1, start_delay_s=30)) == (0, 0.0)
    count = prefill_count(10, 1000, 20_000, BUDGET_S, 0.8, Backlog(100_000, serving=1, start_delay_s=30))
    assert (count.workers, count.reason) == (1, Reason.SLO)  # the rate's; at once, the queue would ask 12
    # nothing queued now: no backlog from the predicted rate alone, however short the fleet falls
    assert backlog_workers(40_000, 20_000, BUDGET_S, Backlog(0, serving=1, start_delay_s=30)) == (0, 0.0)


def test_a_backlog_left_when_workers_come_is_cleared_within_the_start_delay() -> None:
    # 40 000 tok/s arriving, 1 worker serving 20 000: 100 000 + 20 000 x 30 s = 700 000 tokens left in 30 s,
    # then (40 000 + 700 000 / 30 s) / 20 000 = 3.2 -> 4 workers (the rate's 2.5 -> 3)
    assert backlog_workers(40_000, 20_000, BUDGET_S, Backlog(100_000, serving=1, start_delay_s=30)) == (4, 700_000)
    count = prefill_count(40, 1000, 20_000, BUDGET_S, 0.8, Backlog(100_000, serving=1, start_delay_s=30))
    assert (count.workers, count.reason) == (4, Reason.BACKLOG)
    assert "700000 left when a worker asked now comes (in 30 s); cleared within 30.00 s" in count.why


def test_decode_batch_and_workers_from_the_sims_own_line() -> None:
    line = Line(a=0.004, c=0.0001)  # the sim engine's step: 4 ms + 0.1 ms a request
    assert line.batch_at(0.020 * 0.9) == 140  # ⌊(18 − 4)/0.1⌋
    # 100 req/s x 200 tokens x 18 ms = 360 running / 140 a worker = 2.6 -> 3
    count = decode_count(100, 200, 140, line.itl_s(140), running=0)
    assert (count.workers, count.reason) == (3, Reason.SLO)
    assert decode_count(100, 200, 140, line.itl_s(140), running=500).workers == 4  # 500 running / 140: the backlog


def test_kv_bounds_the_batch() -> None:
    assert kv_batch(1000, 10) == 90  # 90 % of 1000 blocks at 10 a request
    assert kv_batch(None, 10) is None
    assert kv_batch(1000, None) is None


@pytest.mark.parametrize(
    ("workers", "dp_size", "expected"), [(5, 4, (8, 2)), (4, 4, (4, 1)), (0, 4, (0, 0)), (3, 1, (3, 3))]
)
def test_grouped_roles_round_to_whole_groups(workers: int, dp_size: int, expected: tuple[int, int]) -> None:
    assert grouped(workers, dp_size) == expected


CONFIG = PlannerConfig(ttft_slo_s=0.5, itl_slo_s=0.020)


def test_the_first_reading_only_measures() -> None:
    decision = Planner(CONFIG).step(reading(0.0, prefiller(), decoder()))
    assert (decision.prefill.reason, decision.decode.reason) == (Reason.MEASURING, Reason.MEASURING)
    assert (decision.prefill.desired, decision.decode.desired) == (1, 1)  # the current counts


def test_two_readings_by_hand() -> None:
    planner = Planner(CONFIG)
    kv = {"total_kv_blocks": 10_000, "free_kv_blocks": 9_000, "running": 10}  # 100 blocks a request
    planner.step(reading(0.0, prefiller(), decoder(**kv)))
    # 10 s: 100 prompts of 1000 tokens in 5 s of prefill (20 000 tok/s); 100 outputs of 200 tokens
    decision = planner.step(reading(10.0, prefiller(prefills=100, busy_s=5.0), decoder(decodes=100, **kv)))
    assert decision.arrivals_rps == pytest.approx(10)
    assert (decision.prompt_tokens, decision.output_tokens) == (pytest.approx(1000), pytest.approx(200))
    assert decision.prefill_tokens_per_s == pytest.approx(20_000)
    assert (decision.prefill.desired, decision.prefill.reason) == (1, Reason.SLO)
    # the one decode point meets the ITL target (10 ms): no fit, no feedback; the KV cache holds 90
    assert decision.batch_at_slo == 90
    assert (decision.decode.desired, decision.decode.reason) == (1, Reason.HELD)
    assert decision.describe().startswith("prefill 1 -> 1 (slo: 10.0 req/s predicted x 1000 uncached tokens")


def test_decode_is_not_sized_for_requests_still_waiting_for_their_kv() -> None:
    """A decode worker reserves blocks at placement: its ``waiting`` holds requests queued at prefill,
    whose decode is already in the arrivals x output term. 400 of them would have asked 5 workers."""
    planner = Planner(CONFIG)
    kv = {"total_kv_blocks": 10_000, "free_kv_blocks": 9_000, "running": 10}  # a batch of 90 by the KV cache
    planner.step(reading(0.0, prefiller(), decoder(**kv)))
    waiting = decoder(decodes=100, waiting=400, **kv)
    decision = planner.step(reading(10.0, prefiller(prefills=100, busy_s=5.0), waiting))
    assert (decision.decode.desired, decision.decode.reason) == (1, Reason.HELD)


def test_a_queue_the_serving_prefill_workers_clear_before_a_new_one_comes_adds_none() -> None:
    queued = prefiller(prefills=100, busy_s=5.0, queued_prefill_tokens=30_000)  # 10 req/s, 1.5 s of work queued
    for delay_s, expected in ((30.0, (1, Reason.SLO)), (0.0, (4, Reason.BACKLOG))):
        planner = Planner(dataclasses.replace(CONFIG, start_delay_s=delay_s))
        planner.step(reading(0.0, prefiller()))
        decision = planner.step(reading(10.0, queued))
        assert (decision.prefill.desired, decision.prefill.reason) == expected


def test_a_step_rise_adds_prefill_workers_at_once_and_a_dp_role_whole_groups() -> None:
    planner = Planner(CONFIG)
    ranks = [decoder(f"d{i}", dp_size=4) for i in range(4)]
    planner.step(reading(0.0, prefiller(), *ranks))
    busy = prefiller(prefills=400, busy_s=20.0)  # 40 req/s at 20 000 tok/s
    ranks = [
        decoder(f"d{i}", dp_size=4, decodes=400, batch=10 * (i + 1), itl_s=0.004 + 0.001 * (i + 1)) for i in range(4)
    ]
    decision = planner.step(reading(10.0, busy, *ranks))
    assert (decision.prefill.desired, decision.prefill.actual) == (3, 1)
    # the four ranks measured 10..40 a step at 5..8 ms: itl = 4 ms + 0.1 ms·b, batch at 18 ms = 140
    assert decision.batch_at_slo == 140
    # 40 req/s x 200 x 18 ms = 144 running / 140 = 2 ranks: one whole group of 4
    assert (decision.decode.desired, decision.decode.groups) == (4, 1)


def test_a_prefix_cache_lowers_the_prompt_to_compute() -> None:
    planner = Planner(CONFIG)
    planner.step(reading(0.0, prefiller()))
    half = prefiller(prefills=400, busy_s=10.0, prompt_tokens_cached=200_000)  # half of 400 000 cached
    decision = planner.step(reading(10.0, half))
    assert decision.hit_ratio == pytest.approx(0.5)
    assert decision.prefill_tokens_per_s == pytest.approx(20_000)
    assert decision.prefill.desired == 2  # 40 req/s x 500 uncached / (20 000 x 0.8) = 1.25


def test_a_fall_is_held_for_the_scale_down_window() -> None:
    planner = Planner(dataclasses.replace(CONFIG, predictor="last"))
    planner.step(reading(0.0, prefiller()))
    assert planner.step(reading(10.0, prefiller(prefills=400, busy_s=20.0))).prefill.desired == 3  # 40 req/s
    fell = planner.step(reading(20.0, prefiller(prefills=410, busy_s=20.5)))  # 1 req/s
    assert (fell.prefill.desired, fell.prefill.reason) == (3, Reason.HELD)
    assert fell.describe().startswith("prefill 1 -> 3 (held: 1 computed, 3 kept for the scale-down window)")
    later = planner.step(reading(40.0, prefiller(prefills=430, busy_s=21.5)))  # the 3 (at 10 s) left the window
    assert (later.prefill.desired, later.prefill.reason) == (1, Reason.SLO)


def test_short_prefills_add_up_across_intervals_to_one_rate() -> None:
    planner = Planner(CONFIG)  # min_busy_s 0.2: 0.1 s of prefill an interval is too little alone
    planner.step(reading(0.0, prefiller()))
    first = planner.step(reading(1.0, prefiller(prefills=2, busy_s=0.1)))
    assert (first.prefill_tokens_per_s, first.prefill.reason) == (None, Reason.MEASURING)
    second = planner.step(reading(2.0, prefiller(prefills=4, busy_s=0.2)))
    assert second.prefill_tokens_per_s == pytest.approx(20_000)  # 4000 tokens over the two intervals' 0.2 s
    assert second.prefill.reason is Reason.SLO


def test_busy_time_with_no_token_computed_is_no_rate() -> None:
    # every prompt served whole by the prefix cache (twins), or the busy time counted a beat before the tokens
    assert prefill_count(10, 1000, 0, BUDGET_S, 0.8, Backlog(0)).reason is Reason.MEASURING  # no division
    planner = Planner(CONFIG)
    planner.step(reading(0.0, prefiller()))
    cached = planner.step(reading(1.0, prefiller(prefills=10, busy_s=0.5, prompt_tokens_cached=10_000)))
    assert cached.prefill_tokens_per_s is None
    assert (cached.prefill.desired, cached.prefill.reason) == (1, Reason.MEASURING)
    measured = planner.step(reading(2.0, prefiller(prefills=20, busy_s=1.0, prompt_tokens_cached=10_000)))
    assert measured.prefill_tokens_per_s == pytest.approx(20_000)  # the next interval that computed measures
    assert measured.prefill.reason is Reason.SLO


def test_decode_falls_by_the_largest_batch_that_met_the_target() -> None:
    # ITL 20 ms; the points are all at batch 10, 10 ms: no spread, no line. `peak`, so that the predicted
    # rate decays over the intervals after the traffic (with `last` it is 0 at once: no demand at all)
    planner = Planner(dataclasses.replace(CONFIG, predictor="peak"))
    decoders = [decoder(f"d{i}") for i in range(4)]
    planner.step(reading(0.0, prefiller(), *decoders))
    # 20 req/s x 200 tokens x 10 ms = 40 running, 10 a worker: the 4 running
    decoders = [decoder(f"d{i}", decodes=50) for i in range(4)]
    steady = planner.step(reading(10.0, prefiller(prefills=200, busy_s=10.0), *decoders))
    assert (steady.decode.desired, steady.decode.reason, steady.batch_at_slo) == (4, Reason.HELD, None)
    idle = [planner.step(reading(at, prefiller(prefills=200, busy_s=10.0), *decoders)) for at in range(20, 110, 10)]
    assert idle[0].decode.desired == 4  # the 4 computed at 10 s is in the scale-down window
    assert (idle[-1].decode.desired, idle[-1].decode.reason) == (1, Reason.SLO)  # the predicted rate decays
    assert idle[-1].decode.why.endswith("/ batch 10 (batch 10 met the ITL target)")


def test_decode_with_no_demand_at_all_falls_to_the_least() -> None:
    planner = Planner(dataclasses.replace(CONFIG, min_workers=1, scale_down_window_s=0))
    planner.step(reading(0.0, decoder("d1"), decoder("d2")))  # never any traffic: no batch, no length measured
    idle = planner.step(reading(10.0, decoder("d1"), decoder("d2")))
    assert (idle.decode.desired, idle.decode.reason) == (1, Reason.SLO)
    held = planner.step(reading(20.0, decoder("d1", running=1), decoder("d2")))  # one request running: not idle
    assert (held.decode.desired, held.decode.reason) == (2, Reason.MEASURING)


def test_prefill_with_no_demand_at_all_falls_to_the_least() -> None:
    """Never measured (no prompt came) or measured long ago: with none predicted or queued, no prefill
    worker is needed; a queue, or a request unread, keeps it."""
    planner = Planner(dataclasses.replace(CONFIG, min_workers=1, scale_down_window_s=0))
    planner.step(reading(0.0, prefiller("p1"), prefiller("p2"), decoder()))
    idle = planner.step(reading(10.0, prefiller("p1"), prefiller("p2"), decoder()))
    assert (idle.prefill.desired, idle.prefill.reason) == (1, Reason.SLO)
    queued = planner.step(reading(20.0, prefiller("p1", queued_prefill_tokens=500), prefiller("p2"), decoder()))
    assert (queued.prefill.desired, queued.prefill.reason) == (2, Reason.MEASURING)
    unread = planner.step(dataclasses.replace(reading(30.0, prefiller("p1"), prefiller("p2"), decoder()), unread=1))
    assert (unread.prefill.desired, unread.prefill.reason) == (2, Reason.MEASURING)


def test_a_role_with_no_worker_yet_measures_at_its_last_count() -> None:
    config = dataclasses.replace(CONFIG, min_workers=1)
    first = Planner(config).step(reading(0.0))  # `up` starts the planner before any worker registered
    assert (first.prefill.desired, first.prefill.reason) == (1, Reason.MEASURING)
    assert first.describe() == (
        "prefill 0 -> 1 (measuring: no prefill worker registered yet); decode 0 -> 1 (measuring: no decode worker"
        " registered yet)"
    )
    planner = Planner(config)
    planner.step(reading(0.0, prefiller("p1"), prefiller("p2"), decoder("d1"), decoder("d2"), decoder("d3")))
    gone = [planner.step(reading(at)) for at in (10.0, 50.0)]  # all restarting, past the scale-down window
    assert [(d.prefill.desired, d.decode.desired) for d in gone] == [(2, 3), (2, 3)]
    assert {(d.prefill.reason, d.decode.reason) for d in gone} == {(Reason.MEASURING, Reason.MEASURING)}


def test_whole_groups_never_pass_the_most_advised() -> None:
    planner = Planner(dataclasses.replace(CONFIG, max_workers=6))
    planner.step(reading(0.0, *(prefiller(f"p{i}", dp_size=4) for i in range(4))))
    # 100 req/s x 1000 tokens / (20 000 tok/s x 0.8) = 6.25 -> 7 -> 6 at most; 2 groups of 4 would be 8
    ranks = [prefiller(f"p{i}", dp_size=4, prefills=250, busy_s=12.5) for i in range(4)]
    decision = planner.step(reading(10.0, *ranks))
    assert (decision.prefill.desired, decision.prefill.groups) == (4, 1)


def test_every_float_setting_must_be_finite() -> None:
    for name in (
        "ttft_slo_s",
        "itl_slo_s",
        "interval_s",
        "scale_down_window_s",
        "min_busy_s",
        "ttft_reserve",
        "start_delay_s",
    ):
        with pytest.raises(ValueError, match=f"{name} must be finite"):
            dataclasses.replace(CONFIG, **{name: math.inf})
    with pytest.raises(ValueError, match="itl_slo_s must be finite"):
        dataclasses.replace(CONFIG, itl_slo_s=math.nan)


def test_no_prompt_predicted_or_queued_needs_no_prefill_worker_whatever_the_rate() -> None:
    """An idle fleet falls to its minimum even when no prefill rate was ever measured."""
    for rate in (0, 20_000):
        idle = prefill_count(0, 1000, rate, BUDGET_S, 0.8, Backlog(0))
        assert (idle.workers, idle.reason) == (0, Reason.SLO)
    assert prefill_count(0, 1000, 0, BUDGET_S, 0.8, Backlog(5000)).reason is Reason.MEASURING  # a queue, no rate


def test_a_negative_start_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="start_delay_s must be >= 0"):
        dataclasses.replace(CONFIG, start_delay_s=-1.0)
