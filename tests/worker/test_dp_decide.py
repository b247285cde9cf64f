"""The per-step decision every rank of a DP group makes from the same plans (pure logic)."""

from splitbus.worker.dp import StepPlan, bind_late, decide


def plan(rank: int, prefill: bool = False, decode: bool = False, waited: float = 0.0, batch: str = "", of: int = 0) -> StepPlan:
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
    assert bind_late("none", idle_group[0], plan(0, prefill=True), idle_group, 20.0) == "none"  # nobody steps: next step
    waiting = [plan(0, prefill=True, waited=3, batch="b1", of=2), plan(1, decode=True)]
    assert bind_late("idle", waiting[0], waiting[0], waiting, 20.0) == "idle"  # posted its prefill: alignment decided
    part = plan(1, prefill=True, decode=True, waited=1, batch="b2", of=2)  # rank 1's part came after its plan
    others = [plan(0, decode=True), plan(1, decode=True)]
    assert bind_late("decode", others[1], part, others, 20.0) == "decode"  # rank 0's part is not in yet
    assert bind_late("decode", others[1], part, others, 0.0) == "prefill"  # alignment off
