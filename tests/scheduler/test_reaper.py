"""The reaper's clean-up of a dead worker's keys, and the registry's of a stopped one: nothing of a
worker outlives ``dead_worker_keep_s`` (worker ids carry a pid, so every restart is a new id)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.control import ControlServer
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP, WORKER_GROUP
from splitbus.bus.core.loops import Loops
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.dispatch import DispatchOutcome
from splitbus.bus.messages import Cancel, Failed, Finished, GenerateRequest, Task
from splitbus.bus.records import Reservation, Reserved, WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.reservations import Reservations
from splitbus.bus.results import ResultReader, ResultWriter
from splitbus.placement.decision import Placement
from splitbus.placement.dispatcher import Dispatcher
from splitbus.scheduler.config import SchedulerConfig
from splitbus.scheduler.scheduler import Scheduler
from tests.placement.snapshot import current_handoff, request, tasks_in, worker
from tests.worker.replies import decoded

KEEP_S = 2


@pytest.fixture
def config(bus_config: BusConfig) -> BusConfig:
    return dataclasses.replace(bus_config, dead_worker_keep_s=KEEP_S)


@pytest.fixture
async def scheduler(config: BusConfig) -> AsyncIterator[Scheduler]:
    scheduler = Scheduler(SchedulerConfig(config))
    yield scheduler
    await scheduler.redis.aclose()


async def _join(redis: aioredis.Redis, config: BusConfig, worker_id: str, lease_ms: int) -> Registry:
    """What a worker does at start: its task and control streams, then its record and lease."""
    await GroupConsumer(redis, config, config.keys.tasks(worker_id), WORKER_GROUP, worker_id).ensure_group()
    await ControlServer(redis, config, worker_id, {}).start()
    registry = Registry(redis, config)
    await registry.register(WorkerRecord(worker_id=worker_id, role="decode", model="tiny"), lease_ms=lease_ms)
    return registry


def _own(config: BusConfig, worker_id: str) -> list[str]:
    keys = config.keys
    return [keys.worker(worker_id), keys.tasks(worker_id), keys.ctrl(worker_id), keys.lease(worker_id)]


async def _existing(redis: aioredis.Redis, names: list[str]) -> list[str]:
    return [name for name in names if await redis.exists(name)]


async def test_a_dead_workers_keys_expire_after_the_retention(
    redis: aioredis.Redis, config: BusConfig, scheduler: Scheduler
) -> None:
    await _join(redis, config, "d-1", lease_ms=50)
    await asyncio.sleep(0.1)  # the lease runs out: the worker is dead
    await scheduler.view.refresh()
    assert [w.alive for w in scheduler.view.workers] == [False]
    assert await scheduler.reaper.reap("d-1") == 0
    keys = config.keys
    assert b"d-1" not in await redis.zrange(keys.workers, 0, -1)
    assert (await redis.hget(keys.worker("d-1"), "state")) == b"dead"
    for name in _own(config, "d-1")[:3]:  # kept a while for operators, but not for good
        assert 0 < await redis.ttl(name) <= KEEP_S, name
    await asyncio.sleep(KEEP_S + 0.5)
    assert await _existing(redis, _own(config, "d-1")) == []


async def test_a_stopped_worker_leaves_only_expiring_streams(redis: aioredis.Redis, config: BusConfig) -> None:
    registry = await _join(redis, config, "s-1", lease_ms=5000)
    await registry.deregister("s-1")
    worker, tasks, ctrl, lease = _own(config, "s-1")
    assert await _existing(redis, [worker, lease]) == []
    assert 0 < await redis.ttl(tasks) <= KEEP_S and 0 < await redis.ttl(ctrl) <= KEEP_S


async def test_a_worker_back_under_its_old_id_keeps_its_keys(
    redis: aioredis.Redis, config: BusConfig, scheduler: Scheduler
) -> None:
    await _join(redis, config, "p-0", lease_ms=50)  # compose names workers prefill-0, decode-0
    await asyncio.sleep(0.1)
    await scheduler.reaper.reap("p-0")
    await _join(redis, config, "p-0", lease_ms=5000)
    for name in _own(config, "p-0")[:3]:
        assert await redis.ttl(name) == -1, name  # its record and streams would vanish under it
    assert await redis.hget(config.keys.worker("p-0"), "state") is None
    await scheduler.view.refresh()
    assert [w.alive for w in scheduler.view.workers] == [True]


async def test_a_failed_reap_ends_neither_the_pass_nor_the_loop(
    scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OOM inside the reaper's result write (a ResponseError, not a connection error) used to
    end the reaper's loop silently, and dead workers were never reaped again."""
    from redis.exceptions import ResponseError

    reaped: list[str] = []

    async def reap(worker_id: str) -> int:
        reaped.append(worker_id)
        if worker_id == "w-oom":
            raise ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
        if worker_id == "w-bug":
            raise RuntimeError("a bug in one reap")
        return 0

    reaper = scheduler.reaper
    monkeypatch.setattr(reaper, "reap", reap)
    reaper.view.workers = [worker(w, "decode", alive=False) for w in ("w-oom", "w-bug", "w-ok")]
    loops = Loops("the scheduler")
    loops.start(reaper.reap_dead, every_s=0.01)  # as the scheduler runs it
    for _ in range(500):
        if len(reaped) >= 6:
            break
        await asyncio.sleep(0.01)
    await asyncio.wait_for(loops.close(), 5)
    assert reaped[:6] == ["w-oom", "w-bug", "w-ok"] * 2  # every worker, pass after pass
    assert loops.exit_code == 0  # and the loop did not stop the scheduler


def _moved(outcome: str) -> float:
    return REGISTRY.get_sample_value("splitbus_scheduler_tasks_moved_total", {"outcome": outcome}) or 0.0


async def test_a_request_whose_prefill_and_decode_workers_both_die_is_moved_once(
    redis: aioredis.Redis, config: BusConfig, scheduler: Scheduler
) -> None:
    # The reaper of P moves the request to a live pair; D's task of the first dispatch is then
    # void, and the reaper of D only acks it: one live dispatch, and no error for the client.
    load = WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000)
    # An older entry in d1's stream, so its task's id differs from p1's (written in the same
    # millisecond, both would be <ms>-0, and the mark per moved entry would hide a second move).
    await redis.xadd(config.keys.tasks("d1"), {"type": "x"}, id="9999999999999-0")
    for worker_id, role, lease_ms in (
        ("p1", "prefill", 50),
        ("d1", "decode", 50),
        ("p2", "prefill", 30_000),
        ("d2", "decode", 30_000),
    ):
        tasks = GroupConsumer(redis, config, config.keys.tasks(worker_id), WORKER_GROUP, worker_id)
        await tasks.ensure_group(start_id="$")
        await Registry(redis, config).register(
            WorkerRecord(worker_id=worker_id, role=role, model="m", load=load), lease_ms=lease_ms
        )
    requests = GroupConsumer(redis, config, config.keys.requests, SCHEDULER_GROUP, "s1")
    await requests.ensure_group()
    await Producer(redis, config).send(config.keys.requests, request())
    (entry,) = await requests.read(1)
    first = [
        Placement(worker("d1", "decode"), "decode", "p1", Reserved(0, 1, 8)),
        Placement(worker("p1", "prefill"), "prefill", "d1", Reserved(100, 0, 0)),
    ]
    assert (
        await Dispatcher(redis, config, 60).dispatch(entry.entry_id, entry.message, first) is DispatchOutcome.DISPATCHED
    )
    await asyncio.sleep(0.1)  # p1 and d1 die
    await scheduler.view.refresh()
    before = {outcome: _moved(outcome) for outcome in ("moved", "acked")}
    assert await scheduler.reaper.reap("p1") == 1
    assert await scheduler.reaper.reap("d1") == 1
    assert {outcome: _moved(outcome) - count for outcome, count in before.items()} == {"moved": 1, "acked": 1}
    written = {w: await tasks_in(redis, config.keys.tasks(w)) for w in ("p2", "d2")}
    assert [(t.phase, t.peer) for t in written["p2"]] == [("prefill", "d2")]
    assert [(t.phase, t.peer) for t in written["d2"]] == [("decode", "p2")]
    assert written["p2"][0].handoff == written["d2"][0].handoff == await current_handoff(redis, config, "r")
    for dead in ("p1", "d1"):
        assert (await redis.xpending(config.keys.tasks(dead), WORKER_GROUP))["pending"] == 0
    assert await redis.xlen(config.keys.out("api", "r")) == 0  # nothing failed it


async def test_a_finished_requests_task_is_only_acked_once_its_stream_is_gone(
    redis: aioredis.Redis, config: BusConfig
) -> None:
    """D wrote the final entry, the API read it (and retired the stream and the hand-off id), D
    died before its ack, and the reaper gets there after the grace: the stream shows nothing sent,
    but the missing hand-off id says the request is over. Its task is acked; nothing runs again."""
    config = dataclasses.replace(config, result_grace_s=0.0)
    load = WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000)
    for worker_id, role, lease_ms in (("d1", "decode", 50), ("p2", "prefill", 30_000), ("d2", "decode", 30_000)):
        await GroupConsumer(redis, config, config.keys.tasks(worker_id), WORKER_GROUP, worker_id).ensure_group("$")
        await Registry(redis, config).register(
            WorkerRecord(worker_id=worker_id, role=role, model="m", load=load), lease_ms=lease_ms
        )
    requests = GroupConsumer(redis, config, config.keys.requests, SCHEDULER_GROUP, "s1")
    await requests.ensure_group()
    await Producer(redis, config).send(config.keys.requests, request())
    (entry,) = await requests.read(1)
    only_d1 = [Placement(worker("d1", "decode"), "decode", "p1", Reserved(0, 1, 8))]
    assert (
        await Dispatcher(redis, config, 60).dispatch(entry.entry_id, entry.message, only_d1)
        is DispatchOutcome.DISPATCHED
    )
    d1 = GroupConsumer(redis, config, config.keys.tasks("d1"), WORKER_GROUP, "d1")
    assert len(await d1.read(10, block_ms=0)) == 1
    reader = ResultReader(config, redis, name="api")
    await reader.start()
    try:
        sub = await reader.subscribe("r")
        writer = ResultWriter(redis, config)
        out = config.keys.out(reader.reader_of("r"), "r")
        writer.open("r", reader=reader.reader_of("r"))
        writer.tokens("r", [1, 2])
        writer.finish("r", "length", 4, 2)
        await writer.flush()
        assert isinstance([r async for r in sub][-1], Finished)
        for _ in range(200):  # the reader retires both (grace 0), in its next pipeline
            if not await redis.exists(out, config.keys.current("r")):
                break
            await asyncio.sleep(0.01)
        assert not await redis.exists(out, config.keys.current("r"))
    finally:
        await reader.close()
    await asyncio.sleep(0.1)  # d1 dies before its ack
    scheduler = Scheduler(SchedulerConfig(config))
    try:
        await scheduler.view.refresh()
        assert await scheduler.reaper.reap("d1") == 1
    finally:
        await scheduler.redis.aclose()
    assert [await redis.xlen(config.keys.tasks(w)) for w in ("p2", "d2")] == [0, 0]
    assert (await redis.xpending(config.keys.tasks("d1"), WORKER_GROUP))["pending"] == 0
    assert not await redis.exists(out, config.keys.out("api", "r"))  # no error written either


class _AckFailsOnce(GroupConsumer):
    """A dead worker's task stream as the reaper reads it, whose first ``XACK`` fails (Redis gone
    for an instant): the reaper's next pass takes the task again."""

    failed = False

    async def ack(self, *entry_ids: str) -> int:
        if not self.failed:
            self.failed = True
            raise RedisConnectionError("Connection reset by peer")
        return await super().ack(*entry_ids)


@pytest.mark.parametrize(("handoff", "outcome"), [("h-replaced", "acked"), ("", "failed")])
async def test_a_task_whose_ack_fails_is_counted_once_at_the_pass_that_acks_it(
    redis: aioredis.Redis, config: BusConfig, scheduler: Scheduler, handoff: str, outcome: str
) -> None:
    """``acked``: its dispatch was replaced (another hand-off id is current); ``failed``: it was
    moved too often already (nothing is live to take it either)."""
    await redis.set(config.keys.current("r"), b"h-current")
    await redis.set(config.keys.moved("r"), config.max_deliveries)
    stream = _AckFailsOnce(redis, config, config.keys.tasks("d1"), f"reaper.{scheduler.reaper.name}", "d1")
    await stream.ensure_group()
    await Producer(redis, config).send(config.keys.tasks("d1"), Task("decode", request(), peer="p1", handoff=handoff))
    (delivery,) = await stream.read(1, block_ms=0)
    before = _moved(outcome)
    with pytest.raises(RedisConnectionError):
        await scheduler.reaper.move("d1", stream, delivery)
    assert _moved(outcome) == before  # not acked: not counted (the next pass does it)
    assert await scheduler.reaper.move("d1", stream, delivery)
    assert _moved(outcome) == before + 1
    assert (await redis.xpending(config.keys.tasks("d1"), f"reaper.{scheduler.reaper.name}"))["pending"] == 0


@pytest.mark.parametrize(("made_for", "cancelled"), [("h1", True), ("h0", False)])
async def test_a_dead_prefill_workers_decode_side_is_freed_only_for_its_dispatch(
    redis: aioredis.Redis, config: BusConfig, scheduler: Scheduler, made_for: str, cancelled: bool
) -> None:
    # The reaper moves a dead P's prefill task: the D that reserved for that dispatch is told to
    # drop that one task; a reservation made for another dispatch (a newer one's D) is left alone.
    reservation = Reservation("d-1", "127.0.0.1:9", 4, "p-0", "7-0", "secret", handoff=made_for)
    await Reservations(redis, config.keys).reserve("r", reservation)
    await scheduler.reaper.release_decode_side(Task("prefill", request(), peer="d-1", handoff="h1"))
    sent = [codec.decode(fields) for _, fields in await redis.xrange(config.keys.cancel)]
    assert sent == ([Cancel("r", "moved", "d-1", "7-0")] if cancelled else [])


async def _group_rank(redis: aioredis.Redis, config: BusConfig, worker_id: str, rank: int, lease_ms: int) -> None:
    """A rank of prefill group p0 (2 ranks) joins: its task stream, its record and lease."""
    await GroupConsumer(redis, config, config.keys.tasks(worker_id), WORKER_GROUP, worker_id).ensure_group("$")
    load = WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000, dp_epoch=1)
    record = WorkerRecord(
        worker_id=worker_id, role="prefill", model="m", load=load, dp_group="p0", dp_rank=rank, dp_size=2
    )
    await Registry(redis, config).register(record, lease_ms=lease_ms)


async def _dispatch_to_p0(redis: aioredis.Redis, config: BusConfig, deadline_ms: int) -> None:
    """The only prefill group, p0 (ranks pa, pb), and decode worker d2; request r goes to pa and d2."""
    await _group_rank(redis, config, "pa", 0, 50)
    await _group_rank(redis, config, "pb", 1, 50)
    await GroupConsumer(redis, config, config.keys.tasks("d2"), WORKER_GROUP, "d2").ensure_group("$")
    load = WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000)
    await Registry(redis, config).register(WorkerRecord(worker_id="d2", role="decode", model="m", load=load), 30_000)
    requests = GroupConsumer(redis, config, config.keys.requests, SCHEDULER_GROUP, "s1")
    await requests.ensure_group()
    await Producer(redis, config).send(config.keys.requests, dataclasses.replace(request(), deadline_ms=deadline_ms))
    (entry,) = await requests.read(1)
    assert isinstance(entry.message, GenerateRequest)
    placements = [
        Placement(worker("d2", "decode"), "decode", "pa", Reserved(0, 1, 8)),
        Placement(worker("pa", "prefill"), "prefill", "d2", Reserved(100, 0, 0)),
    ]
    assert (
        await Dispatcher(redis, config, 60).dispatch(entry.entry_id, entry.message, placements)
        is DispatchOutcome.DISPATCHED
    )
    await asyncio.sleep(0.1)  # the group breaks: both ranks' leases lapse


async def test_a_broken_prefill_groups_task_waits_for_the_group_to_re_form_then_moves_to_it(
    redis: aioredis.Redis, config: BusConfig, scheduler: Scheduler
) -> None:
    await _dispatch_to_p0(redis, config, deadline_ms=int((time.time() + 60) * 1000))
    await scheduler.view.refresh()
    for _ in range(config.max_deliveries + 1):  # pass after pass: kept, never dead-lettered as delivered too often
        assert await scheduler.reaper.reap("pa") == 0  # no complete prefill group: it waits
        assert (await redis.xpending(config.keys.tasks("pa"), WORKER_GROUP))["pending"] == 1
    assert await redis.xlen(config.keys.dead) == 0
    assert await redis.hget(config.keys.worker("pa"), "state") != b"dead"  # not marked: reaped again
    assert await redis.xlen(config.keys.out("api", "r")) == 0  # no error for the client
    await _group_rank(redis, config, "pc", 0, 30_000)  # the group re-forms: its ranks restarted
    await _group_rank(redis, config, "pd", 1, 30_000)
    await scheduler.view.refresh()
    assert await scheduler.reaper.reap("pa") == 1  # the next pass takes it again and moves it
    moved = [*await tasks_in(redis, config.keys.tasks("pc")), *await tasks_in(redis, config.keys.tasks("pd"))]
    assert [t.phase for t in moved] == ["prefill"] and moved[0].handoff == await current_handoff(redis, config, "r")
    assert (await redis.xpending(config.keys.tasks("pa"), WORKER_GROUP))["pending"] == 0
    assert await redis.hget(config.keys.worker("pa"), "state") == b"dead"
    assert await redis.xlen(config.keys.out("api", "r")) == 0


async def test_a_broken_prefill_groups_task_fails_with_503_once_its_deadline_passes(
    redis: aioredis.Redis, config: BusConfig, scheduler: Scheduler
) -> None:
    await _dispatch_to_p0(redis, config, deadline_ms=int(time.time() * 1000) + 150)
    await scheduler.view.refresh()
    assert await scheduler.reaper.reap("pa") == 0  # waits: the deadline has not passed yet
    await asyncio.sleep(0.2)
    assert await scheduler.reaper.reap("pa") == 1
    (failed,) = await decoded(redis, config.keys.out("api", "r"))
    assert isinstance(failed, Failed) and failed.code == "worker_died" and failed.status == 503
    assert "its DP group did not re-form before the request's deadline" in failed.message
    assert (await redis.xpending(config.keys.tasks("pa"), WORKER_GROUP))["pending"] == 0
