"""The scheduler against a real Redis: the stagger windows (dp and splitwise_dp modes), where they read a
group's step end, and the replicas' leases and claims."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from splitbus.bus.core import codec
from splitbus.bus.core.codec import NamedRequest
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.messages import Failed
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry, SchedulerLease, WorkerRecord
from splitbus.bus.request_stream import Submissions
from splitbus.bus.tenants import Tenant, TenantLimits, TenantStore
from splitbus.placement.decision import NoPlacement
from splitbus.placement.policies.stagger import next_boundary
from splitbus.placement.stagger import RELEASE_LEAD_S
from splitbus.scheduler.config import SchedulerConfig
from splitbus.scheduler.scheduler import BUSY_POLL_MS, Scheduler, Verdict, Waiting
from tests.placement.snapshot import request, tasks_in


@pytest.fixture
async def scheduler(bus_config: BusConfig) -> AsyncIterator[Scheduler]:
    scheduler = Scheduler(SchedulerConfig(bus_config, mode="dp"))
    yield scheduler
    await scheduler.redis.aclose()


async def _ranks(redis: aioredis.Redis, bus_config: BusConfig, ends_ms: list[int]) -> None:
    registry = Registry(redis, bus_config)
    for rank, end_ms in enumerate(ends_ms):
        record = WorkerRecord(
            worker_id=f"g0-r{rank}",
            role="mixed",
            model="tiny",
            engine="sim",
            dp_group="g0",
            dp_rank=rank,
            dp_size=len(ends_ms),
        )
        await registry.register(record, lease_ms=5000)
        await registry.report_load(record.worker_id, WorkerLoad(forward_ends_ms=end_ms, dp_epoch=1))


async def test_window_closes_just_before_the_slowest_rank_ends(
    redis: aioredis.Redis, bus_config: BusConfig, scheduler: Scheduler
) -> None:
    # Both clocks are read together, before the set-up: the ends are announced on the wall clock, the boundary
    # comes back on the monotonic one, and however long the set-up takes on a busy machine it moves neither.
    now_ms, start = int(time.time() * 1000), time.monotonic()
    await _ranks(redis, bus_config, [now_ms + 30, now_ms + 120])  # a decode and a long prefill
    await scheduler.view.refresh()
    expected = start + 0.12 - RELEASE_LEAD_S
    assert await next_boundary(scheduler.view, scheduler.registry) == pytest.approx(expected, abs=0.02)


async def test_a_group_that_has_not_stepped_gives_a_boundary_already_past(
    redis: aioredis.Redis, bus_config: BusConfig, scheduler: Scheduler
) -> None:
    await _ranks(redis, bus_config, [0, 0])  # ranks that have not stepped yet
    await scheduler.view.refresh()
    assert await next_boundary(scheduler.view, scheduler.registry) < time.monotonic()


async def _held_by(
    redis: aioredis.Redis, bus_config: BusConfig, name: str, lease_ms: int | None, message: Any = None
) -> str:
    """A request entry (``message``, else ``request()``) read (and left pending) by replica
    ``name``, whose lease is held for ``lease_ms`` (None: it holds none: dead, or hung past it)."""
    consumer = GroupConsumer(redis, bus_config, bus_config.keys.requests, SCHEDULER_GROUP, name)
    await consumer.ensure_group()
    await Producer(redis, bus_config).send(bus_config.keys.requests, message or request())
    if lease_ms is not None:
        await SchedulerLease(redis, bus_config, name, lease_ms).renew()
    return (await consumer.read(1))[0].entry_id


def _replica(bus_config: BusConfig, name: str, **kwargs: float) -> Scheduler:
    return Scheduler(SchedulerConfig(bus_config, mode="splitwise", name=name, **kwargs))  # type: ignore[arg-type]


async def test_a_replica_claims_what_a_replica_without_lease_holds_at_once(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    entry = await _held_by(redis, bus_config, "hung", lease_ms=None)
    live = _replica(bus_config, "live")
    try:
        assert [d.entry_id for d in await live.claim_from_gone()] == [entry]  # no idle bound
        assert await live.requests.owns(entry)
        assert await live.claim_from_gone() == []
    finally:
        await live.redis.aclose()


async def test_a_replica_that_holds_its_lease_keeps_its_entries(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    entry = await _held_by(redis, bus_config, "busy", lease_ms=5000)
    live = _replica(bus_config, "live")
    try:
        assert await live.claim_from_gone() == []
        assert await live.requests.claim_idle() == []  # claim_idle_ms (30 s) is for stuck ones
        assert [c.pending for c in await live.requests.consumers() if c.name == "busy"] == [1]
        assert entry
    finally:
        await live.redis.aclose()


async def test_a_gone_replica_with_nothing_pending_leaves_the_group_after_the_keep(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    entry = await _held_by(redis, bus_config, "gone", lease_ms=None)
    await redis.xack(bus_config.keys.requests, SCHEDULER_GROUP, entry)
    live = _replica(bus_config, "live", dead_consumer_keep_s=0.2)
    try:
        await live.claim_from_gone()
        assert [c.name for c in await live.requests.consumers()] == ["gone"]  # idle less than the keep
        await asyncio.sleep(0.3)
        await live.claim_from_gone()
        assert await live.requests.consumers() == []
    finally:
        await live.redis.aclose()


async def test_a_woken_replica_does_not_fail_a_request_it_lost(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """Its monotonic clock ran while it was stopped, so what it waited on looks overdue; the
    entry belongs to the claimer now, and the client gets no 503 from the woken one."""
    await _held_by(redis, bus_config, "woken", lease_ms=None)
    woken, live = _replica(bus_config, "woken"), _replica(bus_config, "live")
    try:
        delivery = (await woken.requests.claim_idle(min_idle_ms=0))[0]  # its view of what it read
        await live.claim_from_gone()
        assert not await woken.fail(Waiting(delivery, 0.0), "no_worker", "none", 503)
        assert not await redis.exists(bus_config.keys.out("api", "r"))
        assert await live.requests.owns(delivery.entry_id)
    finally:
        await woken.redis.aclose()
        await live.redis.aclose()


async def test_a_request_waits_for_a_worker_then_fails_with_the_policys_reason(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    await _held_by(redis, bus_config, "s1", lease_ms=5000)
    replica = _replica(bus_config, "s1", no_worker_wait_s=1.0)
    try:
        delivery = (await replica.requests.claim_idle(min_idle_ms=0))[0]
        waiting = Waiting(delivery, time.monotonic())
        assert await replica.decide(waiting) is Verdict.WAIT  # no worker yet: it waits
        waiting.since -= 2  # waited longer than no_worker_wait_s
        assert await replica.decide(waiting) is Verdict.DROP
        entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", await redis.xrange(bus_config.keys.out("api", "r")))
        [failed] = [codec.decode(fields) for _, fields in entries]
        assert isinstance(failed, Failed) and (failed.code, failed.status) == ("no_worker", 503)
        assert failed.message == "no live prefill worker with room serves model 'm'"
        assert not await replica.requests.owns(delivery.entry_id)  # acked: done with
    finally:
        await replica.redis.aclose()


async def test_a_request_that_finds_every_queue_full_waits_past_the_no_worker_wait(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """Workers there with full prefill queues (``NoPlacement.busy``): the request waits in the
    scheduler's queue past ``no_worker_wait_s`` (until its deadline), and nothing is failed; the
    time it waited so is not counted against ``no_worker_wait_s`` if its workers then go. A
    request without a deadline waits no longer than any other."""
    deadline_ms = int(time.time() * 1000) + 60_000
    await _held_by(redis, bus_config, "s1", 5000, dataclasses.replace(request(), deadline_ms=deadline_ms))
    replica = _replica(bus_config, "s1", no_worker_wait_s=1.0)
    busy = NoPlacement("every prefill worker with room for model 'm' has a full prefill queue", busy=True)
    replica.policy = cast("Any", SimpleNamespace(place=lambda *_: busy))
    try:
        delivery = (await replica.requests.claim_idle(min_idle_ms=0))[0]
        waiting = Waiting(delivery, time.monotonic() - 60)
        assert await replica.decide(waiting) is Verdict.WAIT
        assert not await redis.exists(bus_config.keys.out("api", "r"))
        assert await replica.requests.owns(delivery.entry_id)  # still held: not acked, not lost
        replica.policy = cast("Any", SimpleNamespace(place=lambda *_: NoPlacement("no live prefill worker")))
        assert await replica.decide(waiting) is Verdict.WAIT  # its wait for a worker starts now
        timeless = dataclasses.replace(delivery, message=request())  # deadline 0
        replica.policy = cast("Any", SimpleNamespace(place=lambda *_: busy))
        assert await replica.decide(Waiting(timeless, time.monotonic() - 60)) is Verdict.DROP
    finally:
        await replica.redis.aclose()


async def test_a_full_model_is_asked_once_a_pass_and_the_loop_looks_again_soon(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """Once the policy finds every queue of a model full, the pass's later requests of that model
    wait without asking it again (placing them could only add to full queues), and the loop looks
    again within BUSY_POLL_MS, not refresh_s: the view shows a queue opening within milliseconds.
    A busy answer for this request only (``model_wide`` unset) is not reused."""
    deadline_ms = int(time.time() * 1000) + 60_000
    await _held_by(redis, bus_config, "s1", 5000, dataclasses.replace(request(), deadline_ms=deadline_ms))
    replica = _replica(bus_config, "s1")
    busy = NoPlacement("every prefill worker with room for model 'm' has a full prefill queue", busy=True)
    busy = dataclasses.replace(busy, model_wide=True)
    calls: list[str] = []
    replica.policy = cast("Any", SimpleNamespace(place=lambda request, *_: calls.append(request.request_id) or busy))
    try:
        delivery = (await replica.requests.claim_idle(min_idle_ms=0))[0]
        assert replica._block_ms() is None  # nothing waits: the bus's default block
        now = time.monotonic()
        left = await replica.place_all([Waiting(delivery, now), Waiting(delivery, now)])
        assert len(left) == 2 and calls == ["r"]  # asked once for the two
        replica.waiting = left
        assert replica._block_ms() == BUSY_POLL_MS < replica.config.refresh_s * 1000
        replica.policy = cast("Any", SimpleNamespace(place=lambda request, *_: calls.append("again") or busy))
        await replica.place_all(left)
        assert calls == ["r", "again"]  # a new pass asks again
        mine = dataclasses.replace(busy, model_wide=False)  # full for this request only: ask for each
        replica.policy = cast("Any", SimpleNamespace(place=lambda request, *_: calls.append("each") or mine))
        assert len(await replica.place_all(left)) == 2 and calls[2:] == ["each", "each"]
        assert replica._block_ms() == BUSY_POLL_MS
    finally:
        await replica.redis.aclose()


async def test_a_copy_of_a_running_request_that_waits_for_a_worker_is_not_failed(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A retried XADD's copy waits past no_worker_wait_s while the request runs (its hand-off id
    is set): the copy is acked only, and the live run's stream gets no 503."""
    await _held_by(redis, bus_config, "s1", lease_ms=5000)
    await redis.set(bus_config.keys.current("r"), "h1", ex=600)  # dispatched from the first copy
    replica = _replica(bus_config, "s1", no_worker_wait_s=1.0)
    try:
        delivery = (await replica.requests.claim_idle(min_idle_ms=0))[0]
        assert await replica.decide(Waiting(delivery, time.monotonic() - 2)) is Verdict.DROP
        assert not await redis.exists(bus_config.keys.out("api", "r"))
        assert not await replica.requests.owns(delivery.entry_id)  # acked: a duplicate
    finally:
        await replica.redis.aclose()


async def test_a_dead_lettered_copy_of_a_running_request_is_not_failed(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A copy dead-lettered (here: not decodable as placed) while the request runs leaves the
    live run's stream alone; one of a request nobody dispatched is failed with the reason."""
    await _held_by(redis, bus_config, "s1", lease_ms=5000)
    replica = _replica(bus_config, "s1")
    try:
        delivery = (await replica.requests.claim_idle(min_idle_ms=0))[0]
        await redis.set(bus_config.keys.current("r"), "h1", ex=600)
        await replica.poison(Waiting(delivery, time.monotonic()), "handler_failed: boom")
        await replica.place_waiting()
        assert not await redis.exists(bus_config.keys.out("api", "r"))
        await redis.delete(bus_config.keys.current("r"))
        replica.fail_dead(NamedRequest("r2", "api"), "handler_failed: boom")  # a request never dispatched
        await replica.place_waiting()
        entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", await redis.xrange(bus_config.keys.out("api", "r2")))
        [failed] = [codec.decode(fields) for _, fields in entries]
        assert isinstance(failed, Failed) and (failed.code, failed.status) == ("handler_failed", 500)
    finally:
        await replica.redis.aclose()


async def test_the_lease_is_taken_at_start_renewed_apart_and_released_at_stop(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    replica = _replica(bus_config, "s1", lease_ms=400, heartbeat_s=0.1)
    runner = asyncio.create_task(replica.run())
    lease = SchedulerLease(redis, bus_config, "s1", 400)
    try:
        assert await _eventually(lambda: lease.held(["s1"]), [True])
        await asyncio.sleep(0.6)  # longer than the lease: renewed meanwhile
        assert await lease.held(["s1"]) == [True]
    finally:
        replica.stopping.set()
        await asyncio.wait_for(runner, 10)
    assert await lease.held(["s1"]) == [False]


async def _eventually(check, expected, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while await check() != expected:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_splitwise_dp_sends_a_windows_batch_rank_to_rank_one_dispatch_per_request(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A prefill group of 2 and a decode group of 2 that have not stepped: the window closes at once,
    and each request's decode and prefill tasks go out in one dispatch, naming each other."""
    registry = Registry(redis, bus_config)
    for role, group in (("prefill", "p0"), ("decode", "d0")):
        for i in range(2):
            record = WorkerRecord(f"{group}-r{i}", role, "m", engine="sim", dp_group=group, dp_rank=i, dp_size=2)
            await registry.register(record, lease_ms=5000)
            await registry.report_load(
                record.worker_id, WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000, dp_epoch=1)
            )
    scheduler = Scheduler(SchedulerConfig(bus_config, mode="splitwise_dp", name="s1"))
    try:
        await scheduler.requests.ensure_group()
        await scheduler.view.refresh()
        for i in range(2):
            await Producer(redis, bus_config).send(
                bus_config.keys.requests, dataclasses.replace(request(), request_id=f"r{i}")
            )
        await scheduler.step()
        tasks = {w: await tasks_in(redis, bus_config.keys.tasks(w)) for w in ("p0-r0", "p0-r1", "d0-r0", "d0-r1")}
    finally:
        await scheduler.redis.aclose()
    assert [len(t) for t in tasks.values()] == [1, 1, 1, 1]  # water-filled and balanced over the ranks
    by_request = {t.request.request_id: {} for ts in tasks.values() for t in ts}
    for worker_id, [task] in tasks.items():
        by_request[task.request.request_id][task.phase] = (worker_id, task.peer, task.batch_id, task.batch_ranks)
    for placed in by_request.values():
        (p, p_peer, batch_id, ranks), (d, d_peer, _, _) = placed["prefill"], placed["decode"]
        assert (p_peer, d_peer, ranks) == (d, p, 2) and batch_id.startswith("s1.")
    assert scheduler.waiting == []


_FORGED = {
    "w-negative": {"queued_prefill_tokens": str(-(10**9))},  # drew every prefill before
    "w-huge": {"running": str(10**30), "free_kv_blocks": str(10**30)},  # overflowed the load table's int64 columns
    "w-text": {"queued_prefill_tokens": "none"},
    "w-role": {"role": "boss"},
}
"""What a party with Redis access writes into worker hashes, by worker."""


async def _forge(redis: aioredis.Redis, bus_config: BusConfig, worker: str, fields: dict[str, str]) -> None:
    """Write ``fields`` into the worker's hash and announce them in the registry log, as a load
    report does (a beat, where the record's own fields change)."""
    await redis.hset(bus_config.keys.worker(worker), mapping=fields)  # type: ignore[arg-type]
    op = {"op": "beat", "at": str(int(time.time() * 1000)), "lease": "60000"} if "role" in fields else {"op": "load"}
    entry = {"w": worker, **op, **(_record(worker).to_hash() if "role" in fields else {}), **fields}
    await redis.xadd(bus_config.keys.registry_log, entry)  # type: ignore[arg-type]


def _record(worker: str) -> WorkerRecord:
    load = WorkerLoad(queued_prefill_tokens=10**6 if worker != "w-good" else 5000, free_kv_blocks=1000)
    return WorkerRecord(worker, "mixed", "m", engine="sim", load=dataclasses.replace(load, total_kv_blocks=1000))


def _rejected(source: str) -> float:
    return REGISTRY.get_sample_value("splitbus_bus_registry_rows_rejected_total", {"source": source}) or 0.0


async def _placed_on(redis: aioredis.Redis, bus_config: BusConfig, request_id: str) -> list[str]:
    """The workers a request's tasks went to, once there are any (a few seconds at most)."""
    workers = ["w-good", *_FORGED]
    for _ in range(250):
        tasks = {w: await tasks_in(redis, bus_config.keys.tasks(w)) for w in workers}
        found = [w for w, ts in tasks.items() for t in ts if t.request.request_id == request_id]
        if found:
            return found
        await asyncio.sleep(0.02)
    return []


async def test_forged_worker_loads_draw_no_work_and_stop_no_scheduler(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """The attack: a negative, huge, non-numeric load and an unknown role, written into worker
    hashes (and the registry log) by a party with Redis access. A running scheduler that had
    the workers' good records drops them as the log brings the forgeries, a new one leaves them
    out of its first snapshot; both place on the honest worker and keep running, and each
    refused row is counted."""
    registry = Registry(redis, bus_config)
    for worker in ("w-good", *_FORGED):
        await registry.register(_record(worker), lease_ms=60_000)
    producer = Producer(redis, bus_config)
    first = Scheduler(SchedulerConfig(bus_config, mode="mixed", name="s1"))
    runner = asyncio.create_task(first.run())
    try:
        assert await _eventually(lambda: _live(first), sorted(["w-good", *_FORGED]))
        logged = _rejected("log")
        for worker, fields in _FORGED.items():
            await _forge(redis, bus_config, worker, fields)
        await producer.send(bus_config.keys.requests, dataclasses.replace(request(), request_id="r1"))
        assert await _placed_on(redis, bus_config, "r1") == ["w-good"]
        assert _rejected("log") == logged + len(_FORGED) and not runner.done()
    finally:
        first.stopping.set()
        await asyncio.wait_for(runner, 10)
    assert first.exit_code == 0
    second = Scheduler(SchedulerConfig(bus_config, mode="mixed", name="s2"))
    snapshots = _rejected("snapshot")
    runner = asyncio.create_task(second.run())
    try:
        await producer.send(bus_config.keys.requests, dataclasses.replace(request(), request_id="r2"))
        assert await _placed_on(redis, bus_config, "r2") == ["w-good"]
        assert _rejected("snapshot") >= snapshots + len(_FORGED) and not runner.done()
    finally:
        second.stopping.set()
        await asyncio.wait_for(runner, 10)
    assert second.exit_code == 0


async def _live(scheduler: Scheduler) -> list[str]:
    return sorted(w.record.worker_id for w in scheduler.view.live())


async def test_a_responses_choices_go_to_one_pair_each_prefill_task_saying_how_many(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """Written together, read together: the first choice placed by the policy, the others after
    it, and P told that three come (``Task.twins``), which it waits for to prefill them once."""
    registry = Registry(redis, bus_config)
    workers = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    for worker, role in workers.items():
        load = WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000)
        await registry.register(WorkerRecord(worker, role, "m", engine="sim", load=load), lease_ms=60_000)
    choices = [
        dataclasses.replace(request(), request_id=f"cmpl-1-{i}", choices=3, choice_group="cmpl-1") for i in range(3)
    ]
    scheduler = _replica(bus_config, "s1")
    runner = asyncio.create_task(scheduler.run())
    try:
        assert await _eventually(lambda: _live(scheduler), sorted(workers))
        await Submissions(redis, Producer(redis, bus_config), bus_config.keys).submit_together(choices)

        async def tasks() -> dict[str, list[tuple[str, int]]]:
            found = {w: await tasks_in(redis, bus_config.keys.tasks(w)) for w in workers}
            return {w: sorted((t.request.request_id, t.twins) for t in ts) for w, ts in found.items() if ts}

        assert await _eventually(lambda: _count(tasks()), 6)
        placed = await tasks()
        prefill = [ts for w, ts in placed.items() if workers[w] == "prefill"]
        decode = [ts for w, ts in placed.items() if workers[w] == "decode"]
        assert prefill == [[(f"cmpl-1-{i}", 3) for i in range(3)]]  # one P, told of three
        assert decode == [[(f"cmpl-1-{i}", 1) for i in range(3)]]  # one D
    finally:
        scheduler.stopping.set()
        await asyncio.wait_for(runner, 10)


async def _count(tasks: Awaitable[dict[str, list[tuple[str, int]]]]) -> int:
    return sum(len(ts) for ts in (await tasks).values())


async def test_the_waiting_queue_goes_by_priority_then_fair_share_then_arrival(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """One mixed worker with KV room for three requests; tenant A's backlog of five arrives first,
    then B's one, then C's one at a higher priority (a lower value). C's goes first, then A's
    first and B's (each tenant's first at an equal share, by arrival); A's other four wait, in
    arrival order, and the tenants' served prompt tokens are counted."""
    load = WorkerLoad(free_kv_blocks=24, total_kv_blocks=1000)  # 8 blocks a request (128 tokens, blocks of 16)
    await Registry(redis, bus_config).register(
        WorkerRecord("w0", "mixed", "m", engine="sim", load=load), lease_ms=60_000
    )
    sent = [("a0", "A", 0), ("a1", "A", 0), ("a2", "A", 0), ("a3", "A", 0), ("a4", "A", 0), ("b0", "B", 0)]
    sent.append(("c0", "C", -1))
    scheduler = Scheduler(SchedulerConfig(bus_config, mode="mixed", name="s1"))
    try:
        await scheduler.requests.ensure_group()
        await scheduler.view.refresh()
        for request_id, tenant, priority in sent:
            message = dataclasses.replace(request(), request_id=request_id, tenant=tenant, priority=priority)
            await Producer(redis, bus_config).send(bus_config.keys.requests, message)
        await scheduler.step()
        placed = sorted(t.request.request_id for t in await tasks_in(redis, bus_config.keys.tasks("w0")))
        left = [w.delivery.message.request_id for w in scheduler.waiting]  # type: ignore[union-attr]
        served = dict(scheduler.served.decayed(time.monotonic()))
    finally:
        await scheduler.redis.aclose()
    assert placed == ["a0", "b0", "c0"]  # in arrival order alone: a0, a1, a2
    assert left == ["a1", "a2", "a3", "a4"]
    assert REGISTRY.get_sample_value("splitbus_scheduler_tenant_queued_requests", {"tenant": "A"}) == 4
    assert served == {
        "A": pytest.approx(100, rel=0.01),
        "B": pytest.approx(100, rel=0.01),
        "C": pytest.approx(100, rel=0.01),
    }


async def test_a_replica_takes_the_tenants_weights_from_the_store(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    store = TenantStore(redis, bus_config.keys)
    await store.add(Tenant("heavy", limits=TenantLimits(weight=3.0)))
    await store.add(Tenant("light"))
    scheduler = _replica(bus_config, "s1")
    await scheduler.read_weights()
    assert scheduler.weights == {"heavy": 3.0, "light": 1.0}
    await store.set("heavy", weight=0.5)
    await scheduler.read_weights()
    assert scheduler.weights["heavy"] == 0.5


def test_a_dead_workers_requests_are_moved_without_the_queue_bound(bus_config: BusConfig) -> None:
    """The reaper places a dead worker's requests again with the policy less the bound: they were
    admitted long ago, and the bound would fail them when every survivor's queue is full."""
    config = SchedulerConfig(bus_config, mode="splitwise", name="s1", max_queued_prefill_tokens=512)
    bounded = Scheduler(config)
    assert bounded.policy.options.max_queued_prefill_tokens == 512
    assert bounded.reaper.policy.options.max_queued_prefill_tokens == 0
    assert type(bounded.reaper.policy) is type(bounded.policy)
    plain = Scheduler(dataclasses.replace(config, max_queued_prefill_tokens=0))
    assert plain.reaper.policy is plain.policy
    with pytest.raises(ValueError, match="splitwise and mixed"):
        dataclasses.replace(config, mode="dp")
