"""The registry view against a real Redis: a snapshot, then every change from the registry log
as it happens (beats, loads, reservations, departures), leases running out on their own, and
drift repaired by the next snapshot."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.dispatch import DispatchScript, TaskWrite
from splitbus.bus.messages import Task
from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.registry_view import RegistryView
from tests.placement.snapshot import request


def _record(worker_id: str, role: str = "decode") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, model="tiny", engine="sim")


async def _d1_seen(redis: aioredis.Redis, bus_config: BusConfig, full_every_s: float) -> tuple[Registry, RegistryView]:
    """Decode worker d1 registered, and a view that has read it in a snapshot."""
    registry = Registry(redis, bus_config)
    await registry.register(_record("d1"), lease_ms=5000)
    view = RegistryView(registry, redis, full_every_s=full_every_s)
    await view.refresh()
    return registry, view


async def _caught_up(view: RegistryView) -> None:
    """Read the log until a read returns nothing new (its block ends)."""
    await view.follow()
    await view.follow()


async def test_changes_reach_the_view_as_they_happen(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("d1"), lease_ms=5000)
    view = RegistryView(registry, redis, full_every_s=3600)  # no second snapshot: the log alone
    await view.refresh()
    assert [w.record.worker_id for w in view.live()] == ["d1"]
    snapshot_reads = view.read_at

    await registry.register(_record("p1", "prefill"), lease_ms=5000)  # a new worker: its whole record
    load = WorkerLoad(running=2, queued_prefill_tokens=300, free_kv_blocks=70, total_kv_blocks=100)
    await registry.heartbeat("d1", load, lease_ms=5000)
    await _caught_up(view)
    rows = {w.record.worker_id: w for w in view.workers}
    assert rows["p1"].record.role == "prefill" and rows["p1"].alive
    assert rows["d1"].record.load == load and view.read_at > snapshot_reads

    # a dispatch's reservation, then the worker taking the task and giving it back
    consumer = GroupConsumer(redis, bus_config, bus_config.keys.requests, SCHEDULER_GROUP, "s1")
    await consumer.ensure_group()
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    (delivery,) = await consumer.read(1)
    script = DispatchScript(redis, bus_config, 60)
    entry = script.request_entry(delivery.entry_id, "r")
    task = Task("decode", delivery.message, "p1", reserved=[0, 1, 8])
    assert await script.write(entry, "r", "h1", [TaskWrite("d1", task)]) == 1
    await _caught_up(view)
    assert {w.record.worker_id: w for w in view.workers}["d1"].reserved == Reserved(0, 1, 8)
    await registry.report_load("d1", WorkerLoad(running=3, free_kv_blocks=62, total_kv_blocks=100), Reserved(0, 1, 8))
    await _caught_up(view)
    d1 = {w.record.worker_id: w for w in view.workers}["d1"]
    assert d1.reserved == Reserved() and d1.record.load.running == 3

    await registry.resign("p1")  # gives up its lease: not live at once
    await registry.mark_dead("d1")  # the reaper took it: out of the view
    await _caught_up(view)
    assert [w.record.worker_id for w in view.workers] == ["p1"] and view.live() == []


async def test_every_writer_spells_the_log_entries_as_views_read_them(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """The registry log on the wire, as the heartbeat and dispatch scripts and ``Registry._log``
    write it (field names and order, ``op`` words): the view reads these bytes."""
    registry = Registry(redis, bus_config)
    await registry.register(_record("d1"), lease_ms=5000)
    await registry.heartbeat("d1", WorkerLoad(running=2), lease_ms=5000)
    consumer = GroupConsumer(redis, bus_config, bus_config.keys.requests, SCHEDULER_GROUP, "s1")
    await consumer.ensure_group()
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    (delivery,) = await consumer.read(1)
    script = DispatchScript(redis, bus_config, 60)
    task = Task("decode", delivery.message, "p1", reserved=[5, 1, 8])
    assert await script.write(script.request_entry(delivery.entry_id, "r"), "r", "h1", [TaskWrite("d1", task)]) == 1
    await registry.report_load("d1", WorkerLoad(running=3), Reserved(5, 1, 8))
    await registry.resign("d1")
    await registry.mark_dead("d1")
    log = [fields for _, fields in await redis.xrange(bus_config.keys.registry_log)]
    beat = [b"w", b"op", b"at", b"lease"]
    assert [list(fields)[:4] for fields in log[:2]] == [beat, beat]
    assert [fields[b"op"] for fields in log] == [b"beat", b"beat", b"reserve", b"load", b"resign", b"gone"]
    assert log[2] == {
        b"w": b"d1",
        b"op": b"reserve",
        b"+reserved_prefill_tokens": b"5",
        b"+reserved_requests": b"1",
        b"+reserved_kv_blocks": b"8",
    }
    assert list(log[3])[:3] == [b"w", b"op", b"running"] and log[3][b"+reserved_kv_blocks"] == b"-8"
    assert log[4:] == [{b"w": b"d1", b"op": b"resign"}, {b"w": b"d1", b"op": b"gone"}]


async def test_a_lease_runs_out_with_no_entry_to_say_so(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("d1"), lease_ms=300)
    view = RegistryView(registry, redis, full_every_s=3600)
    await view.refresh()
    assert view.serves("tiny")
    await asyncio.sleep(0.4)
    await view.follow()  # a read that brings nothing of it
    assert not view.serves("tiny") and not view.workers[0].alive


async def test_a_change_the_log_lost_is_repaired_by_the_next_snapshot(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry, view = await _d1_seen(redis, bus_config, full_every_s=0.3)
    await registry.heartbeat("d1", WorkerLoad(running=5), lease_ms=5000)
    await redis.xtrim(bus_config.keys.registry_log, maxlen=0)  # trimmed before the view read it
    await _caught_up(view)
    assert view.workers[0].record.load.running == 0  # missed
    await asyncio.sleep(0.3)
    await view.follow()  # due: a snapshot
    assert view.workers[0].record.load.running == 5


async def test_a_view_that_stopped_reading_finds_no_lease_run_out(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """A process stopped longer than the leases (SIGSTOP, a GC pause) wakes with a view that missed
    the workers' beats: leases are judged at what it has read, so the workers are still alive to it
    until its next read brings their beats, not all dead (a reaper would reap them)."""
    registry = Registry(redis, bus_config)
    await registry.register(_record("d1"), lease_ms=400)
    view = RegistryView(registry, redis, full_every_s=3600)
    await view.refresh()
    for _ in range(4):  # the worker beats on while the view reads nothing
        await asyncio.sleep(0.2)
        await registry.heartbeat("d1", WorkerLoad(), lease_ms=400)
    assert view.workers[0].alive  # 0.8 s after its last read, past the 0.4 s lease it last saw
    await view.follow()
    assert view.workers[0].alive
    await asyncio.sleep(0.6)  # no beat now: once the view reads again, the lease has run out
    await view.follow()
    assert not view.workers[0].alive


async def test_a_forged_entry_takes_its_worker_out_until_a_snapshot_reads_a_good_record(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry, view = await _d1_seen(redis, bus_config, full_every_s=3600)
    entry = {"w": "d1", "op": "load", "queued_prefill_tokens": str(-(10**9)), "+reserved_requests": "1"}
    await redis.xadd(bus_config.keys.registry_log, entry)  # type: ignore[arg-type]
    await _caught_up(view)
    assert view.live() == []  # not shown with its last good load meanwhile
    await registry.heartbeat("d1", WorkerLoad(running=1), lease_ms=5000)  # a beat of load alone cannot bring it back
    await _caught_up(view)
    assert view.live() == []
    await view.refresh()  # the hash itself was never forged: the snapshot reads it good
    assert [w.record.load.running for w in view.live()] == [1]
