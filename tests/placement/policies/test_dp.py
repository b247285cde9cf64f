"""dp placement on hand-made DP groups (pure logic)."""

from __future__ import annotations

import random

from splitbus.bus.records import Reserved
from splitbus.placement.decision import NoPlacement, Placed
from splitbus.placement.policies import create
from splitbus.placement.policies.base import PolicyOptions
from tests.placement.policies.dp_ranks import rank
from tests.placement.snapshot import request


def test_each_arrival_goes_at_once_to_the_least_queued_rank() -> None:
    ranks = [rank("g0", 0, 2, queued=900), rank("g0", 1, 2, queued=10)]
    plan = create("dp", PolicyOptions(rng=random.Random(0))).place(request(), ranks, {})
    assert isinstance(plan, Placed)
    [placement] = plan.placements
    assert (placement.worker.record.worker_id, placement.phase, placement.batch_id) == ("g0-r1", "mixed", "")
    assert placement.reserve == Reserved(100, 1, 8)


def test_this_replicas_reservations_count_and_an_incomplete_group_takes_nothing() -> None:
    ranks = [rank("g0", 0, 2), rank("g0", 1, 2)]
    plan = create("dp").place(request(), ranks, {"g0-r0": Reserved(reserved_prefill_tokens=5000)})
    assert isinstance(plan, Placed) and plan.placements[0].worker.record.worker_id == "g0-r1"
    missing_a_rank = [rank("g1", 0, 2)]
    assert create("dp").place(request(), missing_a_rank, {}) == NoPlacement(
        "no live DP rank with room serves model 'm'"
    )
