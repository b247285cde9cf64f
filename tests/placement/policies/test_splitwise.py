"""splitwise placement on hand-made registry snapshots (pure logic)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from splitbus.bus.records import Reserved
from splitbus.placement.costs import blocks_needed
from splitbus.placement.decision import Decision, NoPlacement, Placed
from splitbus.placement.disagg import Disaggregation
from splitbus.placement.policies import create
from splitbus.placement.policies.base import Policy, PolicyOptions
from tests.placement.snapshot import request, worker


def _policy(seed: int | None = None) -> Policy:
    return create("splitwise", PolicyOptions(rng=random.Random(seed)))


def _placed(decision: Decision) -> Placed:
    assert isinstance(decision, Placed), decision
    return decision


def _reason(decision: Decision) -> str:
    assert isinstance(decision, NoPlacement), decision
    return decision.reason


def test_prefill_by_queued_tokens_and_decode_by_free_blocks() -> None:
    workers = [
        worker("p-busy", "prefill", queued=5000),
        worker("p-idle", "prefill", queued=10),
        worker("d-full", "decode", free=50),
        worker("d-roomy", "decode", free=900),
    ]
    plan = _policy(0).place(request(), workers, {})
    assert isinstance(plan, Placed)
    decode, prefill = plan.placements
    assert (decode.worker.record.worker_id, decode.phase, decode.peer) == ("d-roomy", "decode", "p-idle")
    assert (prefill.worker.record.worker_id, prefill.phase, prefill.peer) == ("p-idle", "prefill", "d-roomy")
    assert prefill.reserve == Reserved(reserved_prefill_tokens=100)
    assert (
        decode.reserve
        == Reserved(reserved_requests=1, reserved_kv_blocks=blocks_needed(request(), 16))
        == Reserved(0, 1, 8)
    )


def test_decode_ties_on_blocks_go_to_fewer_running() -> None:
    workers = [
        worker("p", "prefill"),
        worker("d-a", "decode", free=900, running=30),
        worker("d-b", "decode", free=880, running=2),
    ]
    plan = _policy(1).place(request(), workers, {})
    assert isinstance(plan, Placed) and plan.placements[0].worker.record.worker_id == "d-b"


def test_reservations_count_as_load() -> None:
    workers = [
        worker("p-a", "prefill", queued=0, reserved=Reserved(reserved_prefill_tokens=8000)),
        worker("p-b", "prefill", queued=500),
        worker("d", "decode"),
    ]
    plan = _policy().place(request(), workers, {"p-b": Reserved()})
    assert isinstance(plan, Placed) and plan.placements[1].worker.record.worker_id == "p-b"
    local = {"p-b": Reserved(reserved_prefill_tokens=20000)}  # this replica's own recent picks
    plan = _policy().place(request(), workers, local)
    assert isinstance(plan, Placed) and plan.placements[1].worker.record.worker_id == "p-a"


def test_near_equal_candidates_are_spread() -> None:
    workers = [worker(f"p{i}", "prefill", queued=100 + i) for i in range(4)] + [worker("d", "decode")]
    policy = _policy(7)
    picks = Counter(
        _placed(policy.place(request(), workers, {})).placements[1].worker.record.worker_id for _ in range(400)
    )
    assert set(picks) == {"p0", "p1", "p2", "p3"}
    assert min(picks.values()) > 50


def test_no_placement_says_why() -> None:
    policy = _policy()
    assert "no live prefill worker" in _reason(policy.place(request(), [worker("d", "decode")], {}))
    dead = [worker("p", "prefill"), worker("d", "decode", alive=False)]
    assert "no live decode worker" in _reason(policy.place(request(), dead, {}))
    full = [worker("p", "prefill"), worker("d", "decode", free=3)]
    assert "decode" in _reason(policy.place(request(), full, {}))
    other_model = [worker("p", "prefill", model="x"), worker("d", "decode", model="x")]
    assert "model 'm'" in _reason(policy.place(request(), other_model, {}))


def test_a_prefill_queue_bound_keeps_requests_off_full_queues() -> None:
    """With ``max_queued_prefill_tokens``, a prefill worker with that many tokens queued (reported
    or reserved) takes no more; when every one is full the request waits, busy, not failed."""
    bounded = create("splitwise", PolicyOptions(rng=random.Random(0), max_queued_prefill_tokens=1000))
    decode = worker("d", "decode")
    open_one = [worker("p-full", "prefill", queued=1000), worker("p-open", "prefill", queued=999), decode]
    assert _placed(bounded.place(request(), open_one, {})).placements[1].worker.record.worker_id == "p-open"
    reserved = {"p-open": Reserved(reserved_prefill_tokens=1)}  # this replica's own reservation counts
    busy = bounded.place(request(), open_one, reserved)
    full = "every prefill worker with room for model 'm' has a full prefill queue"
    assert busy == NoPlacement(full, busy=True, model_wide=True)  # P's room does not depend on the request
    disagg = PolicyOptions(max_queued_prefill_tokens=1000, disagg=Disaggregation(local_prefill_max_tokens=10))
    long_prompt = create("splitwise", disagg).place(request(), open_one, reserved)  # 100 tokens: not local
    assert long_prompt == NoPlacement(full, busy=True)  # a shorter prompt may prefill on D: not model-wide
    unbounded = _policy(0).place(request(), open_one, reserved)  # 0: no bound: both full ones take it, as before
    assert _placed(unbounded).placements[1].worker.record.worker_id in ("p-full", "p-open")
    nobody = bounded.place(request(), [decode], {})
    assert nobody == NoPlacement("no live prefill worker with room serves model 'm'")  # not busy: nobody there


def test_a_request_that_would_head_a_full_queue_is_let_past_the_bound() -> None:
    """The bound holds back what would queue behind: a request of an earlier priority than the
    first in P's queue goes to its head, so it is placed up to twice the bound (the first
    priority is P's last report: what was placed since is not in it); one of the same priority
    waits."""
    bounded = create("splitwise", PolicyOptions(rng=random.Random(0), max_queued_prefill_tokens=1000))
    full = worker("p", "prefill", queued=1500)  # over the bound, under twice it
    full = dataclasses.replace(
        full,
        record=dataclasses.replace(full.record, load=dataclasses.replace(full.record.load, first_queued_priority=0)),
    )
    workers = [full, worker("d", "decode")]
    urgent = dataclasses.replace(request(), priority=-1)
    assert _placed(bounded.place(urgent, workers, {})).placements[1].worker.record.worker_id == "p"
    same = bounded.place(request(), workers, {})
    assert isinstance(same, NoPlacement) and same.busy
    flooded = bounded.place(urgent, workers, {"p": Reserved(reserved_prefill_tokens=500)})  # 2,000 queued
    assert isinstance(flooded, NoPlacement) and flooded.busy  # past twice the bound: even an earlier one waits
