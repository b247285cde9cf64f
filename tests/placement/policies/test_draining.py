"""Every policy places nothing on a draining worker (``WorkerInfo.placeable``), though it would
be the least loaded: a draining worker finishes what it holds and takes no new task."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from splitbus.bus.core.streams import Delivery
from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Phase
from splitbus.placement.decision import Admitted, Placed, Placement, Waiting
from splitbus.placement.ledger import Local
from splitbus.placement.policies import create, names
from splitbus.placement.policies.base import Policy, PolicyOptions
from splitbus.placement.policies.splitwise import SplitwisePolicy
from splitbus.placement.policies.splitwise_dp import SplitwiseDpPolicy
from splitbus.placement.policies.stagger import StaggerPolicy
from splitbus.placement.siblings import Siblings
from tests.placement.policies.dp_ranks import rank
from tests.placement.snapshot import request, worker
from tests.placement.test_siblings import choice


def _with_draining(info: WorkerInfo, flag: int) -> WorkerInfo:
    load = dataclasses.replace(info.record.load, draining=flag)
    return dataclasses.replace(info, record=dataclasses.replace(info.record, load=load))


def draining(info: WorkerInfo) -> WorkerInfo:
    """``info`` with its draining flag set, as its next heartbeat writes it."""
    return _with_draining(info, 1)


def _fleet() -> list[WorkerInfo]:
    """For each kind of worker a policy places on, an idle draining one and a busy placeable one."""
    idle = [
        worker("p-drain", "prefill"),
        worker("d-drain", "decode"),
        worker("m-drain", "mixed"),
        *[rank(f"{role[0]}g-drain", i, 2, role=role) for role in ("prefill", "decode", "mixed") for i in range(2)],
    ]
    busy = [
        worker("p-ok", "prefill", queued=5000),
        worker("d-ok", "decode", free=500, running=8),
        worker("m-ok", "mixed", queued=5000, free=500, running=8),
        *[
            rank(f"{role[0]}g-ok", i, 2, role=role, queued=5000, free=500, running=8)
            for role in ("prefill", "decode", "mixed")
            for i in range(2)
        ],
    ]
    return [*map(draining, idle), *busy]


def _targets(decision: object) -> set[str]:
    assert isinstance(decision, Placed), decision
    return {p.worker.record.worker_id for p in decision.placements}


@pytest.mark.parametrize("name", names())
def test_no_policy_places_on_a_draining_worker(name: str) -> None:
    fleet = _fleet()
    placed: set[str] = set()
    for seed in range(20):
        placed |= _targets(create(name, PolicyOptions(rng=random.Random(seed))).place(request(), fleet, {}))
    assert placed and not any("drain" in worker_id for worker_id in placed)
    # The same fleet with nobody draining: the idle workers are the policy's choice.
    open_fleet = [_with_draining(w, 0) for w in fleet]
    chosen = _targets(create(name, PolicyOptions(rng=random.Random(0))).place(request(), open_fleet, {}))
    assert any("drain" in worker_id for worker_id in chosen)


def _arrivals(n: int) -> list[Waiting]:
    return [Waiting(Delivery("sb:requests", f"{i}-0", request()), time.monotonic()) for i in range(n)]


def _batch_policy(name: str) -> Policy:
    return create(name, PolicyOptions(replica="s1", stagger_max_wait_s=10.0, rng=random.Random(0)))


def _placed(admitted: Admitted) -> set[str]:
    return {worker_id for _, decision in admitted.placed for worker_id in _targets(decision)}


def test_a_stagger_batch_fills_no_draining_rank() -> None:
    policy = _batch_policy("stagger")
    assert isinstance(policy, StaggerPolicy)
    placed = _placed(policy.place_batch(_arrivals(6), _fleet(), {}))
    assert placed and not any("drain" in worker_id for worker_id in placed)


def test_a_draining_prefill_group_fills_no_batch_and_no_draining_decode_rank_is_chosen() -> None:
    policy = _batch_policy("splitwise_dp")
    assert isinstance(policy, SplitwiseDpPolicy)
    arrivals = _arrivals(4)
    assert policy.place_batch("pg-drain", arrivals, _fleet(), {}) == Admitted(arrivals, [])
    placed = _placed(policy.place_batch("pg-ok", arrivals, _fleet(), {}))
    assert {"pg-ok-r0", "pg-ok-r1"} <= placed and not any("drain" in worker_id for worker_id in placed)


def test_a_choice_does_not_follow_its_sibling_to_a_draining_worker() -> None:
    workers = [worker("p0", "prefill"), worker("d0", "decode"), worker("p1", "prefill"), worker("d1", "decode")]
    pair = Placed(
        (
            Placement(workers[1], Phase.DECODE, "p0", Reserved(0, 1, 8)),
            Placement(workers[0], Phase.PREFILL, "d0", Reserved(100)),
        )
    )
    siblings = Siblings()
    siblings.decide(choice(0), workers, Local(), lambda: pair)
    assert siblings.follow(choice(1), workers, Local()) is not None
    later = [workers[0], draining(workers[1]), *workers[2:]]
    assert siblings.follow(choice(1), later, Local()) is None
    policy = SplitwisePolicy(PolicyOptions(rng=random.Random(0)))
    decided = siblings.decide(choice(2), later, Local(), lambda: policy.place(choice(2), later, Local()))
    assert "d0" not in _targets(decided)
