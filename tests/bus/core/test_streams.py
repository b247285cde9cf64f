"""Stream primitives against a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bus.core import codec
from splitbus.bus.core.codec import Message, NamedRequest
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.dead import DeadLetter
from splitbus.bus.core.streams import Delivery, GroupConsumer, Producer, trim_consumed
from splitbus.bus.messages import Cancel, GenerateRequest, SamplingParams

GROUP = "g"


def _msg(i: int) -> Cancel:
    return Cancel(request_id=f"r{i}", reason="test")


async def _consumer(redis: aioredis.Redis, config: BusConfig, name: str = "c1") -> GroupConsumer:
    consumer = GroupConsumer(redis, config, config.keys.requests, GROUP, name)
    await consumer.ensure_group()
    return consumer


async def _dead_letters(redis: aioredis.Redis, config: BusConfig) -> list[DeadLetter]:
    return [codec.decode(fields) for _, fields in await redis.xrange(config.keys.dead)]


async def test_entries_arrive_in_order_and_ack_clears_pending(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer = await _consumer(redis, bus_config)
    producer = Producer(redis, bus_config)
    ids = await producer.send_many([(bus_config.keys.requests, _msg(i)) for i in range(50)])
    got = await consumer.read(100)
    assert [d.message.request_id for d in got] == [f"r{i}" for i in range(50)]
    assert [d.entry_id for d in got] == ids
    assert (await redis.xpending(bus_config.keys.requests, GROUP))["pending"] == 50
    assert await consumer.ack(*ids) == 50
    assert (await redis.xpending(bus_config.keys.requests, GROUP))["pending"] == 0


async def test_read_takes_only_what_capacity_allows(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer = await _consumer(redis, bus_config)
    producer = Producer(redis, bus_config)
    for i in range(5):
        await producer.send(bus_config.keys.requests, _msg(i))
    assert await consumer.read(0) == []
    assert (await redis.xpending(bus_config.keys.requests, GROUP))["pending"] == 0
    first = await consumer.read(2)
    assert [d.message.request_id for d in first] == ["r0", "r1"]
    assert (await redis.xpending(bus_config.keys.requests, GROUP))["pending"] == 2
    rest = await consumer.read(10)
    assert [d.message.request_id for d in rest] == ["r2", "r3", "r4"]


async def test_two_consumers_share_entries_without_overlap(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    a = await _consumer(redis, bus_config, "a")
    b = await _consumer(redis, bus_config, "b")
    await Producer(redis, bus_config).send_many([(bus_config.keys.requests, _msg(i)) for i in range(20)])
    got_a = await a.read(7)
    got_b = await b.read(100)
    ids = [d.message.request_id for d in got_a + got_b]
    assert sorted(ids) == sorted(f"r{i}" for i in range(20))
    assert len(got_a) == 7 and len(got_b) == 13


async def test_undecodable_entry_is_dead_lettered_and_consumer_goes_on(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    consumer = await _consumer(redis, bus_config)
    stream = bus_config.keys.requests
    await redis.xadd(stream, {b"type": b"cancel", b"data": b"{broken"})
    await redis.xadd(stream, {b"garbage": b"1"})
    await Producer(redis, bus_config).send(stream, _msg(1))
    got = await consumer.read(10)
    assert [d.message.request_id for d in got] == ["r1"]
    letters = await _dead_letters(redis, bus_config)
    assert [(letter.reason.split(":")[0], letter.stream) for letter in letters] == [("undecodable", stream)] * 2
    assert letters[0].reason.startswith("undecodable: cancel: data is not JSON")  # the error, not only in the log
    assert letters[1].reason == "undecodable: unknown message type None"
    assert letters[0].original_data == "{broken"
    # Dead-lettered entries are acked: only the good one is pending.
    assert (await redis.xpending(stream, GROUP))["pending"] == 1


async def test_restarted_consumer_gets_its_own_pending_entries_first(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    first = await _consumer(redis, bus_config, "worker-1")
    producer = Producer(redis, bus_config)
    await producer.send_many([(bus_config.keys.requests, _msg(i)) for i in range(3)])
    got = await first.read(2)
    await first.ack(got[0].entry_id)
    await producer.send(bus_config.keys.requests, _msg(3))
    restarted = await _consumer(redis, bus_config, "worker-1")  # same name, fresh process
    again = await restarted.read(1)
    assert [d.message.request_id for d in again] == ["r1"]  # its unacked entry, not a new one
    after = await restarted.read(10)
    assert [d.message.request_id for d in after] == ["r2", "r3"]


async def test_missing_group_is_recreated(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer = await _consumer(redis, bus_config)
    await redis.delete(bus_config.keys.requests)  # as after a restart without persistence
    assert await consumer.read(5, block_ms=10) == []
    await Producer(redis, bus_config).send(bus_config.keys.requests, _msg(9))
    assert [d.message.request_id for d in await consumer.read(5)] == ["r9"]


async def _blocked_read(
    redis: aioredis.Redis, bus_config: BusConfig
) -> tuple[GroupConsumer, asyncio.Task[list[Delivery[Message]]]]:
    """A consumer and its read, blocked in XREADGROUP on the request stream for up to 5 s."""
    consumer = await _consumer(redis, bus_config)
    read = asyncio.create_task(consumer.read(5, block_ms=5000))
    await asyncio.sleep(0.2)
    return consumer, read


async def test_a_blocked_read_whose_stream_is_deleted_recreates_it_and_reads_nothing(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    consumer, read = await _blocked_read(redis, bus_config)
    await redis.delete(bus_config.keys.requests)  # Redis 7: the blocked read gets UNBLOCKED
    assert await asyncio.wait_for(read, 2) == []
    assert await redis.exists(bus_config.keys.requests)  # recreated, with its group
    await Producer(redis, bus_config).send(bus_config.keys.requests, _msg(4))
    assert [d.message.request_id for d in await consumer.read(5)] == ["r4"]


async def test_a_blocked_read_whose_stream_is_replaced_by_another_type_fails_with_wrongtype(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    _, read = await _blocked_read(redis, bus_config)
    await redis.set(bus_config.keys.requests, "not a stream")  # a bug no retry can fix: the caller must see it
    with pytest.raises(aioredis.ResponseError, match="WRONGTYPE"):
        await asyncio.wait_for(read, 2)


async def test_idle_entries_are_claimed_by_another_consumer(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    dead = await _consumer(redis, bus_config, "dead")
    alive = await _consumer(redis, bus_config, "alive")
    await Producer(redis, bus_config).send_many([(bus_config.keys.requests, _msg(i)) for i in range(3)])
    assert len(await dead.read(3)) == 3
    assert await alive.claim_idle(min_idle_ms=60_000) == []  # not idle long enough
    await asyncio.sleep(0.05)
    claimed = await alive.claim_idle(min_idle_ms=20)
    assert [d.message.request_id for d in claimed] == ["r0", "r1", "r2"]
    owners = await redis.xpending_range(bus_config.keys.requests, GROUP, "-", "+", 10)
    assert {o["consumer"] for o in owners} == {b"alive"}


async def test_entry_is_dead_lettered_after_max_deliveries(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    config = dataclasses.replace(bus_config, max_deliveries=3)
    consumers = [await _consumer(redis, config, f"c{i}") for i in range(4)]
    await Producer(redis, config).send(config.keys.requests, _msg(7))
    assert len(await consumers[0].read(1)) == 1  # delivery 1
    for n, consumer in enumerate(consumers[1:3], start=2):  # deliveries 2 and 3, each "crashes"
        await asyncio.sleep(0.02)
        assert len(await consumer.claim_idle(min_idle_ms=10)) == 1, f"delivery {n}"
    await asyncio.sleep(0.02)
    assert await consumers[3].claim_idle(min_idle_ms=10) == []  # would be delivery 4
    letters = await _dead_letters(redis, config)
    assert [(d.reason.split(":")[0], d.deliveries) for d in letters] == [("max_deliveries", 4)]
    assert (await redis.xpending(config.keys.requests, GROUP))["pending"] == 0


async def test_trim_never_removes_unacked_entries(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer = await _consumer(redis, bus_config)
    stream = bus_config.keys.requests
    await Producer(redis, bus_config).send_many([(stream, _msg(i)) for i in range(10)])
    got = await consumer.read(10)
    await consumer.ack(*[d.entry_id for d in got[:4]])  # r0..r3 done, r4..r9 pending
    await consumer.ack(got[6].entry_id)  # an ack out of order does not open a hole to trim
    assert await trim_consumed(redis, stream) == 4
    left = [codec.decode(f).request_id for _, f in await redis.xrange(stream)]
    assert left == [f"r{i}" for i in range(4, 10)]
    await consumer.ack(*[d.entry_id for d in got])
    assert await trim_consumed(redis, stream) == 6
    assert await redis.xlen(stream) == 0


async def test_read_without_block_and_read_within_a_wait(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer = await _consumer(redis, bus_config)
    assert await consumer.read(10, block_ms=0) == []  # 0 is "do not block", never Redis's "block forever"
    assert await consumer.read_within(10, wait_ms=20) == []

    async def later() -> None:
        await asyncio.sleep(0.05)
        await Producer(redis, bus_config).send(bus_config.keys.requests, _msg(1))

    writer = asyncio.create_task(later())
    got = await consumer.read_within(10, wait_ms=5000)
    await writer
    assert [d.message.request_id for d in got] == ["r1"]


async def test_batched_producer_shares_pipelines_between_concurrent_sends(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    producer = Producer(redis, bus_config, batched=True)
    ids = await asyncio.gather(*(producer.send(bus_config.keys.requests, _msg(i)) for i in range(100)))
    assert len(set(ids)) == 100
    assert producer._batcher is not None and producer._batcher.pipelines < 100
    entries = await redis.xrange(bus_config.keys.requests)
    assert [codec.decode(f).request_id for _, f in entries] == [f"r{i}" for i in range(100)]


async def test_trim_survives_acks_between_its_two_reads(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    # XINFO says entries are pending, then every one is acked before XPENDING runs (another
    # replica's ack): XPENDING's min is then nil, and trimming goes on past the last read.
    from splitbus.bus.core import streams

    consumer = await _consumer(redis, bus_config)
    stream = bus_config.keys.requests
    await Producer(redis, bus_config).send_many([(stream, _msg(i)) for i in range(3)])
    got = await consumer.read(3)
    stale = [{**g, "pending": 3} for g in await redis.xinfo_groups(stream)]
    await consumer.ack(*[d.entry_id for d in got])
    floor = await streams._group_floor(redis, stream, stale[0])
    assert streams.entry_order(floor) > streams.entry_order(got[-1].entry_id)


async def test_restarted_consumer_dead_letters_its_pending_entry_past_max_deliveries(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    # A consumer that dies on an entry every time (a crash, not an exception) re-reads it from
    # its pending list at each restart: each re-read counts, and past the bound it is buried.
    config = dataclasses.replace(bus_config, max_deliveries=3)
    told: list[tuple[NamedRequest, str]] = []
    requests = [GenerateRequest(f"r{i}", "m", [1], SamplingParams(), "api-1", 0, "api-1.out.0") for i in (1, 2)]
    await Producer(redis, config).send_many([(config.keys.requests, r) for r in requests])
    runs = []
    for _ in range(4):  # runs 1-3 read r1 and "crash"; run 4 must not get it
        consumer = GroupConsumer(redis, config, config.keys.requests, GROUP, "w", on_dead=lambda *a: told.append(a))
        await consumer.ensure_group()
        runs.append([d.message.request_id for d in await consumer.read(1)])
    assert runs == [["r1"], ["r1"], ["r1"], ["r2"]]
    letters = await _dead_letters(redis, config)
    assert [(d.reason, d.deliveries) for d in letters] == [
        ("max_deliveries: delivered 4 times (bound 3) without an ack", 4)
    ]
    assert [named for named, _ in told] == [NamedRequest("r1", "api-1.out.0")]  # its client can be told
    pending = await redis.xpending_range(config.keys.requests, GROUP, "-", "+", 10)
    assert [p["times_delivered"] for p in pending] == [1]  # only r2, delivered once


async def test_undecodable_entry_naming_a_request_is_reported(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    told: list[tuple[NamedRequest, str]] = []
    consumer = GroupConsumer(redis, bus_config, bus_config.keys.requests, GROUP, "c", on_dead=lambda *a: told.append(a))
    await consumer.ensure_group()
    for data in (
        b'{"request_id":"r9","reason":7,"api_node":"api-1"}',
        b'{"request_id":"r{x}","reason":7,"api_node":"api-1"}',  # r{x} is not trusted
        b'{"request_id":"r8","reason":7}',  # no reader: no result stream to write to
    ):
        await redis.xadd(bus_config.keys.requests, {b"type": b"cancel", b"data": data})
    assert await consumer.read(10) == []
    assert told == [(NamedRequest("r9", "api-1"), "undecodable: cancel: reason must be a string, got int")]


async def test_dead_letters_refused_at_maxmemory_are_kept_and_sent_later(
    redis: aioredis.Redis, bus_config: BusConfig, redis_admin: sync_redis.Redis
) -> None:
    consumer = await _consumer(redis, bus_config)
    await redis.xadd(bus_config.keys.requests, {b"type": b"cancel", b"data": b"{broken"})
    await Producer(redis, bus_config).send(bus_config.keys.requests, _msg(1))
    redis_admin.config_set("maxmemory-policy", "noeviction")
    try:
        redis_admin.config_set("maxmemory", 1)  # every write that needs memory is refused (OOM)
        got = await consumer.read(10)  # reads are not refused; the dead letter is
        assert [d.message.request_id for d in got] == ["r1"]  # the good entry is not lost with it
        assert await redis.exists(bus_config.keys.dead) == 0
    finally:
        redis_admin.config_set("maxmemory", 0)
    assert await consumer.read(10, block_ms=10) == []  # sends the kept letter first
    letters = await _dead_letters(redis, bus_config)
    assert [d.reason.split(":")[0] for d in letters] == ["undecodable"]
    assert (await redis.xpending(bus_config.keys.requests, GROUP))["pending"] == 1  # r1 only


async def test_claim_from_takes_every_entry_of_one_consumer_once(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    gone, other = await _consumer(redis, bus_config, "gone"), await _consumer(redis, bus_config, "other")
    producer = Producer(redis, bus_config)
    await producer.send_many([(bus_config.keys.requests, _msg(i)) for i in range(3)])
    held = await gone.read(2)
    kept = await other.read(1)
    first, second = await _consumer(redis, bus_config, "c1"), await _consumer(redis, bus_config, "c2")
    claimed = await first.claim_from("gone")
    assert [d.entry_id for d in claimed] == [d.entry_id for d in held]  # however fresh: no idle bound
    assert await second.claim_from("gone") == []  # no longer the gone one's: not taken twice
    assert await other.owns(kept[0].entry_id) and not await gone.owns(held[0].entry_id)
    assert all([await first.owns(d.entry_id) for d in held])
    by_name = {c.name: c.pending for c in await first.consumers()}
    assert by_name == {"gone": 0, "other": 1, "c1": 2}  # c2 claimed nothing


async def test_forget_deletes_only_a_consumer_with_nothing_pending(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    busy, idle = await _consumer(redis, bus_config, "busy"), await _consumer(redis, bus_config, "idle")
    assert await idle.consumers() == []
    await Producer(redis, bus_config).send(bus_config.keys.requests, _msg(1))
    assert len(await busy.read(1)) == 1
    await idle.read(1, block_ms=0)  # creates the consumer, reads nothing
    assert not await idle.forget("busy")  # it holds an entry: XGROUP DELCONSUMER would drop it
    assert await busy.forget("idle")
    assert [c.name for c in await busy.consumers()] == ["busy"]
    assert (await redis.xpending(bus_config.keys.requests, GROUP))["pending"] == 1
