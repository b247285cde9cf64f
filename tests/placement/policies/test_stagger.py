"""The stagger policy: arrivals held until the window closes, then water-filled as one batch
(its window against a real Redis: tests/scheduler/test_scheduler.py)."""

from __future__ import annotations

import dataclasses
import time

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Delivery
from splitbus.bus.messages import Cancel
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry
from splitbus.bus.registry_view import RegistryView
from splitbus.placement.decision import Admitted, Waiting
from splitbus.placement.policies import create
from splitbus.placement.policies.base import PlacingContext, PolicyOptions
from splitbus.placement.policies.stagger import StaggerPolicy
from tests.placement.policies.dp_ranks import rank
from tests.placement.snapshot import request, tasks
from tests.placement.windows import busy_window


def _policy() -> StaggerPolicy:
    policy = create("stagger", PolicyOptions(replica="s1", stagger_max_wait_s=10.0))
    assert isinstance(policy, StaggerPolicy)
    return policy


def _arrivals(n: int) -> list[Waiting]:
    return [Waiting(Delivery("sb:requests", f"{i}-0", request()), time.monotonic()) for i in range(n)]


def test_a_batch_spreads_over_the_ranks_with_one_batch_id() -> None:
    ranks = [rank("g0", i, 4) for i in range(4)]
    not_a_request = Waiting(Delivery("sb:requests", "9-0", Cancel("r", "api")), time.monotonic())
    admitted = _policy().place_batch([*_arrivals(3), not_a_request], ranks, {})
    assert admitted.queue == [not_a_request] and admitted.wake_at is None
    assert len({p.worker.record.worker_id for _, p in tasks(admitted.placed)}) == 3
    assert {(p.batch_id, p.batch_ranks) for _, p in tasks(admitted.placed)} == {("s1.0", 3)}


def test_what_finds_no_rank_joins_the_queue() -> None:
    arrivals = _arrivals(2)
    full = [rank("g0", 0, 1, free=3)]
    assert _policy().place_batch(arrivals, full, {}) == Admitted(arrivals, [])


def test_when_the_ranks_are_full_the_lowest_priority_joins_the_queue() -> None:
    """Room for one request's blocks: the batch's lower priority value gets it, though it came last."""
    low = Waiting(Delivery("sb:requests", "1-0", dataclasses.replace(request(), priority=3)), time.monotonic())
    high = Waiting(Delivery("sb:requests", "2-0", dataclasses.replace(request(), priority=-1)), time.monotonic())
    admitted = _policy().place_batch([low, high], [rank("g0", 0, 1, free=9)], {})
    assert admitted.queue == [low] and [w for w, _ in admitted.placed] == [high]


async def test_arrivals_wait_for_the_groups_step_to_end(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    [r] = [rank("g0", 0, 1)]
    await registry.register(r.record, lease_ms=5000)
    ends_ms = int(time.time() * 1000) + 5000
    await registry.report_load(r.record.worker_id, WorkerLoad(free_kv_blocks=1000, forward_ends_ms=ends_ms, dp_epoch=1))
    view = RegistryView(registry, redis)
    await view.refresh()
    policy, arrivals = _policy(), _arrivals(2)
    policy.window = busy_window(10.0, time.monotonic())
    held = await policy.admit(arrivals, PlacingContext(view, registry, {}))
    assert (held.queue, held.placed) == ([], [])  # the rank is in a step for 5 s more
    assert held.wake_at is not None and held.wake_at > time.monotonic() + 1
    policy.window.boundary_at = time.monotonic()  # as if that step had ended
    released = await policy.admit([], PlacingContext(view, registry, {}))
    assert [w for w, _ in tasks(released.placed)] == arrivals and released.wake_at is None
    assert {p.worker.record.worker_id for _, p in tasks(released.placed)} == {"g0-r0"}
