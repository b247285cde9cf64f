"""Worker registry: records (every field range-checked as it is read), leases on the server's clock,
one-round-trip snapshots."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from splitbus.bus.core.config import BusConfig
from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import LOAD_FIELDS, Registry, SchedulerLease, WorkerRecord


def _record(worker_id: str, role: str = "decode") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, model="tiny", engine="sim", transfer_endpoint="127.0.0.1:9")


async def test_register_heartbeat_and_snapshot(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("p1", "prefill"), lease_ms=5000)
    await registry.register(_record("d1"), lease_ms=5000)
    load = WorkerLoad(running=3, waiting=1, queued_prefill_tokens=120, free_kv_blocks=90, total_kv_blocks=100)
    server_ms = await registry.heartbeat("d1", load, lease_ms=5000)
    snap = {w.record.worker_id: w for w in await registry.snapshot()}
    assert set(snap) == {"p1", "d1"}
    assert snap["d1"].record.load == load
    assert snap["d1"].record.role == "decode" and snap["d1"].record.transfer_endpoint == "127.0.0.1:9"
    assert snap["d1"].heartbeat_ms == server_ms
    assert all(w.alive for w in snap.values())
    time_s, time_us = await redis.time()
    assert abs(server_ms - (time_s * 1000 + time_us // 1000)) < 5000  # the server's clock


async def test_a_taken_task_moves_from_reserved_to_the_reported_load(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("m1", "mixed"), lease_ms=5000)
    for name, amount in (("reserved_prefill_tokens", 300), ("reserved_requests", 2), ("reserved_kv_blocks", 30)):
        await redis.hincrby(bus_config.keys.worker("m1"), name, amount)  # what two dispatches reserved
    taken_load = WorkerLoad(waiting=1, queued_prefill_tokens=100, free_kv_blocks=80, total_kv_blocks=100)
    await registry.report_load("m1", taken_load, Reserved(100, 1, 10))  # the worker read one of the two tasks
    (worker,) = await registry.snapshot()
    assert worker.record.load == taken_load and worker.alive
    assert worker.reserved == Reserved(200, 1, 20)


async def test_snapshot_is_one_round_trip(
    redis: aioredis.Redis, bus_config: BusConfig, redis_admin: sync_redis.Redis
) -> None:
    registry = Registry(redis, bus_config)
    for i in range(20):
        await registry.register(_record(f"w{i}"), lease_ms=5000)
    await registry.snapshot()  # load the script
    before = redis_admin.info("stats")["total_commands_processed"]  # INFO: the admin's, not the splitbus user's
    rows = await registry.snapshot()
    after = redis_admin.info("stats")["total_commands_processed"]
    assert len(rows) == 20
    # EVALSHA runs the script's calls inside Redis (ZRANGE, a PTTL and an HGETALL a worker, TIME,
    # XREVRANGE of the registry log); the client sent one command (+1 for INFO).
    assert after - before == 1 + 1 + 20 * 2 + 1 + 2


async def test_expired_lease_means_dead(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("short"), lease_ms=100)
    await registry.register(_record("long"), lease_ms=10_000)
    await asyncio.sleep(0.25)
    alive = {w.record.worker_id: w.alive for w in await registry.snapshot()}
    assert alive == {"short": False, "long": True}


async def test_deregister_removes_everything(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("gone"), lease_ms=5000)
    await registry.deregister("gone")
    assert await registry.snapshot() == []
    assert not await redis.exists(bus_config.keys.worker("gone"), bus_config.keys.lease("gone"))


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="role"):
        WorkerRecord(worker_id="w", role="router", model="m")
    with pytest.raises(ValueError, match="worker_id"):
        WorkerRecord(worker_id="a:b", role="decode", model="m")
    record = WorkerRecord(worker_id="w", role="mixed", model="m", dp_group="g", dp_rank=0, dp_size=4)
    assert WorkerRecord.from_hash(record.to_hash()) == record


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("queued_prefill_tokens", str(-(10**9))),
        ("queued_prefill_tokens", str(10**30)),
        ("queued_prefill_tokens", "lots"),
        ("queued_prefill_tokens", " 12"),
        ("queued_prefill_tokens", "1_000"),
        ("running", "-1"),
        ("waiting", str(2**31)),
        ("free_kv_blocks", "-5"),
        ("total_kv_blocks", str(2**31)),
        ("steps", str(2**63)),
        ("forward_ends_ms", "1.5"),
        ("dp_rank", "-2"),
        ("dp_size", str(2**17)),
        ("block_size", "0"),
        ("max_model_len", ""),
        ("role", "boss"),
        ("model", "m" * 257),
        ("transfer_endpoint", "h" * 1025),
        ("worker_id", ""),
    ],
)
def test_a_record_field_out_of_its_range_is_refused(name: str, value: str) -> None:
    raw = _record("w").to_hash() | {name: value}
    with pytest.raises(ValueError, match=name):
        WorkerRecord.from_hash(raw)


def test_every_integer_field_of_a_record_has_a_range() -> None:
    """A field added to the load or the record without a range fails every parse, not silently."""
    integers = [f.name for f in dataclasses.fields(WorkerLoad) if f.type == "int"]
    assert integers == LOAD_FIELDS  # the load's integer fields come first, its expert load after them
    load = dataclasses.replace(WorkerLoad(*range(1, len(integers) + 1)), draining=1)  # a flag: 0 or 1
    record = WorkerRecord("w", "mixed", "m", load=load)
    assert WorkerRecord.from_hash(record.to_hash()) == record


def test_a_stored_record_that_is_not_utf8_is_refused_naming_its_field() -> None:
    """``Registry.row`` (snapshots and ``splitbus status``) decodes the hash as stored, strictly."""
    stored = {name.encode(): value.encode() for name, value in _record("w").to_hash().items()}
    assert Registry.row(5000, stored).record == _record("w")
    with pytest.raises(ValueError, match="'model' is not UTF-8"):
        Registry.row(5000, stored | {b"model": b"\xff"})


async def test_a_bad_record_is_left_out_of_the_snapshot_and_counted(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    for worker_id in ("good", "negative", "reserving"):
        await registry.register(_record(worker_id), lease_ms=5000)
    await redis.hset(bus_config.keys.worker("negative"), "queued_prefill_tokens", str(-(10**9)))
    await redis.hset(bus_config.keys.worker("reserving"), "reserved_prefill_tokens", str(-(10**9)))  # read as none
    before = _rejected("snapshot")
    rows = {w.record.worker_id: w for w in await registry.snapshot()}
    assert sorted(rows) == ["good", "reserving"] and rows["reserving"].reserved == Reserved()
    assert _rejected("snapshot") == before + 1
    await redis.hset(bus_config.keys.worker("good"), "forward_ends_ms", "soon")
    fields_before = _rejected("field")
    assert await registry.forward_ends(["good"]) == [0]  # none announced, as far as a stagger window goes
    assert _rejected("field") == fields_before + 1


def _rejected(source: str) -> float:
    return REGISTRY.get_sample_value("splitbus_bus_registry_rows_rejected_total", {"source": source}) or 0.0


async def test_snapshot_skips_a_partial_record(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("whole"), lease_ms=5000)
    await registry.heartbeat("partial", WorkerLoad(running=1), lease_ms=5000)  # load only, no role
    assert [w.record.worker_id for w in await registry.snapshot()] == ["whole"]


async def test_forward_ends_are_read_fresh_and_zero_when_never_announced(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    for worker_id in ("r0", "r1"):
        await registry.register(_record(worker_id, "mixed"), lease_ms=5000)
    await registry.report_load("r0", WorkerLoad(forward_ends_ms=1_700_000_000_123))
    assert await registry.forward_ends(["r0", "r1", "gone"]) == [1_700_000_000_123, 0, 0]


async def test_scheduler_lease_lapses_on_the_servers_clock(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    lease = SchedulerLease(redis, bus_config, "s1", lease_ms=200)
    assert not await lease.renew()  # the first take: nothing was held
    assert await lease.renew()
    assert await lease.held(["s1", "s2"]) == [True, False]
    assert 0 < await redis.pttl(bus_config.keys.scheduler_lease("s1")) <= 200
    await asyncio.sleep(0.3)
    assert await lease.held(["s1"]) == [False]
    assert not await lease.renew()  # it had lapsed: the replica knows it lost its entries
    await lease.release()
    assert await lease.held(["s1"]) == [False] and await lease.held([]) == []


async def test_snapshot_follows_workers_that_come_and_go(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    # The script reads the workers the last snapshot knew; one new since then is read after it.
    registry = Registry(redis, bus_config)
    await registry.register(_record("first"), lease_ms=5000)
    assert [w.record.worker_id for w in await registry.snapshot()] == ["first"]
    await registry.register(_record("second"), lease_ms=5000)
    assert {w.record.worker_id for w in await registry.snapshot()} == {"first", "second"}
    await registry.deregister("first")
    (second,) = await registry.snapshot()
    assert second.record == _record("second") and second.alive
    await redis.zadd(bus_config.keys.workers, {"left": 1})  # listed, its record gone (it left meanwhile)
    assert [w.record.worker_id for w in await Registry(redis, bus_config).snapshot()] == ["second"]


def test_the_draining_flag_is_0_or_1() -> None:
    record = WorkerRecord("w", "prefill", "m", load=WorkerLoad(draining=1))
    assert WorkerRecord.from_hash(record.to_hash()).load.draining == 1
    with pytest.raises(ValueError, match="draining must be <= 1"):
        WorkerRecord.from_hash(record.to_hash() | {"draining": "2"})
