"""The per-step decision every rank of a DP group makes from the same plans (pure logic)."""

from splitbus.worker.dp import StepPlan, decide


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
