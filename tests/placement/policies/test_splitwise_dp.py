"""The splitwise_dp policy through the registry: splitwise over prefill and decode DP groups, rank
by rank, with a stagger window per prefill group (its rank-level choices:
tests/placement/test_groups.py; its window in a scheduler step: tests/scheduler/test_scheduler.py)."""

from __future__ import annotations

import dataclasses
import random
import time

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Delivery
from splitbus.bus.messages import Cancel
from splitbus.bus.registry import Registry, WorkerInfo
from splitbus.bus.registry_view import RegistryView
from splitbus.placement.decision import Admitted, NoPlacement, Placed, Waiting
from splitbus.placement.policies import create
from splitbus.placement.policies.base import PlacingContext, PolicyOptions
from splitbus.placement.policies.splitwise_dp import SplitwiseDpPolicy
from tests.placement.policies.dp_ranks import rank
from tests.placement.snapshot import request, tasks, worker
from tests.placement.windows import busy_window


def _policy(seed: int = 0, stagger: bool = True) -> SplitwiseDpPolicy:
    options = PolicyOptions(replica="s1", stagger_max_wait_s=10.0, rng=random.Random(seed), stagger=stagger)
    policy = create("splitwise_dp", options)
    assert isinstance(policy, SplitwiseDpPolicy)
    return policy


def _arrivals(n: int) -> list[Waiting]:
    return [Waiting(Delivery("sb:requests", f"{i}-0", request()), time.monotonic()) for i in range(n)]


def _groups(prefill: int = 2, decode: int = 2) -> list[WorkerInfo]:
    return [
        *[rank("p0", i, prefill, role="prefill") for i in range(prefill)],
        *[rank("d0", i, decode, role="decode") for i in range(decode)],
    ]


def test_with_single_workers_only_it_places_as_splitwise_does() -> None:
    workers = [
        *[worker(f"p{i}", "prefill", queued=100 + 7 * i) for i in range(4)],
        *[worker(f"d{i}", "decode", free=900 - 5 * i, running=i) for i in range(4)],
    ]
    for seed in range(10):
        splitwise = create("splitwise", PolicyOptions(rng=random.Random(seed))).place(request(), workers, {})
        assert _policy(seed).place(request(), workers, {}) == splitwise


def test_a_request_goes_to_a_prefill_rank_and_a_decode_rank_of_complete_groups() -> None:
    workers = [
        rank("p0", 0, 2, role="prefill", queued=900),
        rank("p0", 1, 2, role="prefill"),
        rank("p1", 0, 2, role="prefill"),  # incomplete: rank 1 missing
        rank("d0", 0, 2, role="decode", running=5),
        rank("d0", 1, 2, role="decode", running=1),
    ]
    plan = _policy().place(request(), workers, {})
    assert isinstance(plan, Placed)
    decode, prefill = plan.placements
    assert (decode.worker.record.worker_id, decode.phase, decode.peer) == ("d0-r1", "decode", "p0-r1")
    assert (prefill.worker.record.worker_id, prefill.phase, prefill.peer) == ("p0-r1", "prefill", "d0-r1")


def test_no_complete_group_with_room_is_a_clear_reason() -> None:
    no_decode_room = [rank("p0", 0, 1, role="prefill"), rank("d0", 0, 1, role="decode", free=3)]
    assert _policy().place(request(), no_decode_room, {}) == NoPlacement(
        "no live decode worker or complete decode group with room serves model 'm'"
    )
    prefill_group_short = [rank("p0", 0, 2, role="prefill"), rank("d0", 0, 1, role="decode")]
    assert _policy().place(request(), prefill_group_short, {}) == NoPlacement(
        "no live prefill worker or complete prefill group with room serves model 'm'"
    )


def test_a_closed_window_is_water_filled_over_the_groups_ranks_as_one_batch() -> None:
    policy, arrivals = _policy(), _arrivals(4)
    batch = policy.place_batch("p0", arrivals, _groups(), {})
    left, placed = batch.queue, tasks(batch.placed)
    assert left == []
    assert [w for w, _ in placed] == [a for a in arrivals for _ in range(2)]  # decode, then prefill, per request
    prefills = [p for _, p in placed if p.phase == "prefill"]
    decodes = [p for _, p in placed if p.phase == "decode"]
    assert sorted(p.worker.record.worker_id for p in prefills) == ["p0-r0", "p0-r0", "p0-r1", "p0-r1"]
    assert sorted(p.worker.record.worker_id for p in decodes) == ["d0-r0", "d0-r0", "d0-r1", "d0-r1"]  # balanced
    assert {(p.batch_id, p.batch_ranks) for p in prefills} == {("s1.0", 2)}
    assert {(p.batch_id, p.batch_ranks) for p in decodes} == {("", 0)}


def test_what_finds_no_decode_room_joins_the_queue_and_leaves_the_batch() -> None:
    workers = [*[rank("p0", i, 2, role="prefill") for i in range(2)], rank("d0", 0, 1, role="decode", free=8)]
    arrivals = _arrivals(2)
    batch = _policy().place_batch("p0", arrivals, workers, {})
    left, placed = batch.queue, tasks(batch.placed)
    assert len(left) == 1 and len(placed) == 2  # room for one request's blocks only
    assert {p.batch_ranks for _, p in placed if p.phase == "prefill"} == {1}  # the rank count of what went out
    broken = _policy().place_batch("p0", arrivals, workers[:1] + workers[2:], {})  # p0 lost a rank meanwhile
    assert broken == Admitted(arrivals, [])


def test_a_window_releases_by_priority_so_the_lowest_priority_misses_the_decode_room() -> None:
    """Decode room for one request: of the window's batch the lower priority value gets it,
    although it arrived last."""
    workers = [*[rank("p0", i, 2, role="prefill") for i in range(2)], rank("d0", 0, 1, role="decode", free=8)]
    policy, now = _policy(), time.monotonic()
    arrivals = [
        Waiting(Delivery("sb:requests", f"{i}-0", dataclasses.replace(request(), priority=p)), now)
        for i, p in enumerate((2, 0, -5))
    ]
    window = policy.windows["p0"] = busy_window(10.0, now)
    window.open(now, boundary_at=now)
    for waiting in arrivals:
        window.add(waiting, now)
    batch = policy.place_batch("p0", policy._release("p0"), workers, {})
    assert {w.delivery.entry_id for w, _ in batch.placed} == {"2-0"}
    assert [w.delivery.entry_id for w in batch.queue] == ["1-0", "0-0"]  # by priority: the queue reorders anyway


async def _context(
    redis: aioredis.Redis, bus_config: BusConfig, workers: list[WorkerInfo], ends_ms: int
) -> PlacingContext:
    registry = Registry(redis, bus_config)
    for w in workers:
        await registry.register(w.record, lease_ms=5000)
        await registry.report_load(w.record.worker_id, dataclasses.replace(w.record.load, forward_ends_ms=ends_ms))
    view = RegistryView(registry, redis)
    await view.refresh()
    return PlacingContext(view, registry, {})


async def test_prefill_arrivals_wait_for_their_groups_step_to_end(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    context = await _context(redis, bus_config, _groups(), int(time.time() * 1000) + 5000)
    policy, arrivals = _policy(), _arrivals(2)
    policy.windows["p0"] = busy_window(10.0, time.monotonic())
    not_a_request = Waiting(Delivery("sb:requests", "9-0", Cancel("r", "api")), time.monotonic())
    held = await policy.admit([*arrivals, not_a_request], context)
    assert (held.queue, held.placed) == ([not_a_request], [])  # p0 is in a step for 5 s more
    assert held.wake_at is not None and held.wake_at > time.monotonic() + 1
    policy.windows["p0"].boundary_at = time.monotonic()  # as if that step had ended
    released = await policy.admit([], context)
    assert [w for w, _ in tasks(released.placed)] == [
        a for a in arrivals for _ in range(2)
    ] and released.wake_at is None
    prefills = {p.worker.record.worker_id for _, p in tasks(released.placed) if p.phase == "prefill"}
    assert prefills == {"p0-r0", "p0-r1"} and policy.windows["p0"].opened_at is None


async def test_an_arrival_for_a_single_prefill_worker_is_placed_at_once(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    busy_group = [rank("p0", i, 2, role="prefill", queued=500) for i in range(2)]
    workers = [worker("p-single", "prefill"), *busy_group, *_groups(prefill=0)]
    context = await _context(redis, bus_config, workers, int(time.time() * 1000) + 5000)
    policy = _policy()
    admitted = await policy.admit(_arrivals(1), context)
    assert [p.phase for _, p in tasks(admitted.placed)] == ["decode", "prefill"]
    assert tasks(admitted.placed)[1][1].worker.record.worker_id == "p-single"
    assert (admitted.queue, admitted.wake_at, policy.windows) == ([], None, {})


async def test_without_staggering_every_arrival_joins_the_queue(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    context = await _context(redis, bus_config, _groups(), int(time.time() * 1000) + 5000)
    arrivals = _arrivals(3)
    assert await _policy(stagger=False).admit(arrivals, context) == Admitted(arrivals)


async def test_with_no_prefill_group_arrivals_join_the_queue_for_place(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    workers = [worker("p-single", "prefill"), *_groups(prefill=0)]
    context = await _context(redis, bus_config, workers, 0)
    arrivals = _arrivals(2)
    assert await _policy().admit(arrivals, context) == Admitted(arrivals)


async def test_each_prefill_group_has_its_own_window(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    groups = [rank(g, i, 2, role="prefill") for g in ("p0", "p1") for i in range(2)]
    context = await _context(redis, bus_config, [*groups, *_groups(prefill=0)], int(time.time() * 1000) + 5000)
    policy = _policy()
    policy.windows = {g: busy_window(10.0, time.monotonic()) for g in ("p0", "p1")}
    await policy.admit(_arrivals(4), context)
    assert {g: len(w.held) for g, w in policy.windows.items()} == {"p0": 2, "p1": 2}  # levels water-filled
    assert policy.held_tokens == {"p0": 200, "p1": 200}
    policy.windows["p0"].boundary_at = time.monotonic()  # p0's step ended, p1's goes on
    released = await policy.admit([], context)
    prefills = {p.worker.record.worker_id for _, p in tasks(released.placed) if p.phase == "prefill"}
    assert prefills == {"p0-r0", "p0-r1"} and released.wake_at is not None
    assert [g for g, w in policy.windows.items() if w.opened_at is not None] == ["p1"]


async def test_an_arrival_with_no_other_expected_before_the_step_ends_is_placed_at_once(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A first arrival (no rate yet) for a group in a long step: a batch of one, placed at once."""
    context = await _context(redis, bus_config, _groups(), int(time.time() * 1000) + 5000)
    policy = _policy()
    admitted = await policy.admit(_arrivals(1), context)
    assert [p.phase for _, p in tasks(admitted.placed)] == ["decode", "prefill"] and admitted.wake_at is None
