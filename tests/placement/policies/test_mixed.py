"""mixed placement on hand-made registry snapshots (pure logic)."""

from __future__ import annotations

import random

from splitbus.bus.records import Reserved
from splitbus.placement.decision import NoPlacement, Placed
from splitbus.placement.policies import create
from splitbus.placement.policies.base import PolicyOptions
from tests.placement.snapshot import request, worker


def test_mixed_mode_uses_one_mixed_worker() -> None:
    workers = [worker("x", "mixed", free=100), worker("y", "mixed", free=800), worker("p", "prefill")]
    plan = create("mixed", PolicyOptions(rng=random.Random(0))).place(request(), workers, {})
    assert isinstance(plan, Placed)
    assert [(p.worker.record.worker_id, p.phase, p.peer) for p in plan.placements] == [("y", "mixed", "")]
    assert plan.placements[0].reserve == Reserved(100, 1, 8)


def test_no_mixed_worker_with_room_says_why() -> None:
    full = [worker("x", "mixed", free=3), worker("p", "prefill"), worker("d", "decode")]
    assert create("mixed").place(request(), full, {}) == NoPlacement("no live mixed worker with room serves model 'm'")


def test_a_prefill_queue_bound_keeps_requests_off_full_mixed_queues() -> None:
    """A mixed worker at the bound takes no more; all at it: busy (it waits). Without KV room the
    request is not busy: the bound only applies among workers that have room."""
    bounded = create("mixed", PolicyOptions(rng=random.Random(0), max_queued_prefill_tokens=500))
    workers = [worker("x", "mixed", queued=500), worker("y", "mixed", queued=100, free=100)]
    plan = bounded.place(request(), workers, {})
    assert isinstance(plan, Placed) and plan.placements[0].worker.record.worker_id == "y"
    full = [worker("x", "mixed", queued=500), worker("y", "mixed", queued=600)]
    reason = "every mixed worker with room for model 'm' has a full prefill queue"
    assert bounded.place(request(), full, {}) == NoPlacement(reason, busy=True, model_wide=True)
    # a large request finds x full and no room on y; a small one would fit y: busy for this one only
    mixed = [worker("x", "mixed", queued=600), worker("y", "mixed", queued=0, free=5)]
    assert bounded.place(request(prompt=200), mixed, {}) == NoPlacement(reason, busy=True)
    assert isinstance(bounded.place(request(prompt=10, max_tokens=10), mixed, {}), Placed)
    no_room = [worker("x", "mixed", queued=0, free=3)]
    assert bounded.place(request(), no_room, {}) == NoPlacement("no live mixed worker with room serves model 'm'")
