"""The per-step decision every rank of a DP group makes from the same plans (pure logic)."""

from dataclasses import asdict

import orjson
import pytest

from splitbus.worker.dp import ForwardClock, StepPlan, bind_late, decide, forwards


def plan(
    rank: int, prefill: bool = False, decode: bool = False, waited: float = 0.0, batch: str = "", of: int = 0
) -> StepPlan:
    return StepPlan(rank, prefill, decode, waited, batch, of)


def test_an_idle_group_does_not_step() -> None:
    plans = [plan(0), plan(1)]
    assert decide(plans[0], plans, 20.0) == "none"


def test_ranks_without_work_run_idle_forwards() -> None:
    plans = [plan(0, prefill=True), plan(1), plan(2, decode=True)]
    assert [decide(p, plans, 0.0) for p in plans] == ["prefill", "idle", "decode"]


def test_a_batch_waits_until_every_rank_it_went_to_has_its_part() -> None:
    early = [plan(0, prefill=True, waited=3, batch="b1", of=2), plan(1, decode=True)]
    assert decide(early[0], early, 20.0) == "idle"  # rank 1's part of b1 has not arrived yet
    both = [plan(0, prefill=True, waited=6, batch="b1", of=2), plan(1, prefill=True, batch="b1", of=2)]
    assert [decide(p, both, 20.0) for p in both] == ["prefill", "prefill"]
    late = [plan(0, prefill=True, waited=25, batch="b1", of=2), plan(1)]
    assert decide(late[0], late, 20.0) == "prefill"  # the bound: never wait longer
    assert decide(early[0], early, 0.0) == "prefill"  # alignment off
    unbatched = [plan(0, prefill=True), plan(1)]
    assert decide(unbatched[0], unbatched, 20.0) == "prefill"


def test_work_that_arrived_after_the_plan_joins_the_step() -> None:
    plans = [plan(0), plan(1, prefill=True)]  # rank 0 posted first, with nothing to do
    action = decide(plans[0], plans, 20.0)
    assert action == "idle"
    assert bind_late(action, plans[0], plan(0, prefill=True), plans, 20.0) == "prefill"
    decoding = [plan(0, decode=True), plan(1, prefill=True)]
    assert bind_late("decode", decoding[0], plan(0, prefill=True, decode=True), decoding, 20.0) == "prefill"


def test_late_binding_keeps_the_group_and_alignment_decisions() -> None:
    idle_group = [plan(0), plan(1)]
    assert (
        bind_late("none", idle_group[0], plan(0, prefill=True), idle_group, 20.0) == "none"
    )  # nobody steps: next step
    waiting = [plan(0, prefill=True, waited=3, batch="b1", of=2), plan(1, decode=True)]
    assert bind_late("idle", waiting[0], waiting[0], waiting, 20.0) == "idle"  # posted its prefill: alignment decided
    part = plan(1, prefill=True, decode=True, waited=1, batch="b2", of=2)  # rank 1's part came after its plan
    others = [plan(0, decode=True), plan(1, decode=True)]
    assert bind_late("decode", others[1], part, others, 20.0) == "decode"  # rank 0's part is not in yet
    assert bind_late("decode", others[1], part, others, 0.0) == "prefill"  # alignment off


def test_forward_clock_learns_each_kind_of_forward() -> None:
    clock = ForwardClock()
    assert clock.estimate("prefill", 500) == 0.0 and clock.estimate("decode", 0) == 0.0  # nothing seen yet
    clock.observe("prefill", 1000, 0.2)
    clock.observe("decode", 0, 0.03)
    assert clock.estimate("prefill", 500) == pytest.approx(0.1) and clock.estimate("decode", 0) == pytest.approx(0.03)
    clock.observe("decode", 0, 0.08)  # an EWMA: one slow step moves it a fifth of the way
    assert clock.estimate("decode", 0) == pytest.approx(0.04)
    assert clock.estimate("idle", 0) == 0.0


def test_forward_clock_learns_a_prefills_fixed_part_once_it_has_seen_two_sizes() -> None:
    """Under EP a prefill has a large fixed part (the exchanges); a per-token rate learned from
    short prompts made a long prompt's step several times too long."""
    clock = ForwardClock()
    for _ in range(3):
        clock.observe("prefill", 64, 0.051 + 0.0003 * 64)
    assert clock.estimate("prefill", 1024) == pytest.approx(1024 * (0.051 / 64 + 0.0003))  # one size: per token
    clock.observe("prefill", 1024, 0.051 + 0.0003 * 1024)
    assert clock.estimate("prefill", 512) == pytest.approx(0.051 + 0.0003 * 512)
    assert clock.estimate("prefill", 1024) == pytest.approx(0.3582)  # not the 1.12 s the rate alone gave


def test_a_rank_busy_with_an_older_batch_does_not_hold_back_a_newer_one() -> None:
    # Rank 1 is still on b1 (its oldest work) but holds its part of b2 as well: b2 has arrived.
    plans = [plan(0, prefill=True, waited=3, batch="b2", of=2), StepPlan(1, True, False, 40.0, "b1", 2, ("b1", "b2"))]
    assert [decide(p, plans, 20.0) for p in plans] == ["prefill", "prefill"]
    without = [plans[0], StepPlan(1, True, False, 40.0, "b1", 2, ("b1",))]
    assert decide(without[0], without, 20.0) == "idle"  # b2's other part is not in yet


def test_a_plan_survives_the_group_stream() -> None:
    sent = StepPlan(2, True, False, 1.5, "b1", 3, ("b1", "b2"))
    assert StepPlan.from_json(orjson.dumps(asdict(sent))) == sent


def test_every_ranks_forward_and_its_tokens_come_from_the_same_plans() -> None:
    plans = [
        StepPlan(0, True, True, 0.0, prefill_tokens=300, decode_seqs=5),
        StepPlan(1, False, True, 0.0, decode_seqs=7),
        StepPlan(2, False, False, 0.0),
        StepPlan(3, True, False, 3.0, "b1", 2, prefill_tokens=900),  # waits for b1's other part
    ]
    assert forwards(plans, 20.0) == [("prefill", 300), ("decode", 7), ("idle", 0), ("idle", 0)]
    assert forwards(plans[2:3], 20.0) == [("none", 0)]


def test_token_counts_in_a_plan_read_from_the_stream_are_checked() -> None:
    sent = StepPlan(1, True, True, 2.0, prefill_tokens=64, decode_seqs=3)
    assert StepPlan.from_json(orjson.dumps(asdict(sent))) == sent
    bad = {**asdict(sent), "prefill_tokens": "many", "decode_seqs": -4}
    assert StepPlan.from_json(orjson.dumps(bad)) == StepPlan(1, True, True, 2.0)
    old = {k: v for k, v in asdict(sent).items() if k not in ("prefill_tokens", "decode_seqs")}
    assert StepPlan.from_json(orjson.dumps(old)) == StepPlan(1, True, True, 2.0)  # a rank of the previous version
