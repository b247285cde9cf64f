"""The request and task streams as their modules name them, against a real Redis: what API
nodes submit, schedulers read; what a worker leaves unread is counted; acked entries trim."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.request_stream import (
    Unplaced,
    backlog,
    request_consumer,
    submit,
    trim_requests,
    unplaced_requests,
    unread_requests,
)
from splitbus.bus.tasks import task_consumer, trim_tasks, unread_tasks

DEADLINE_MS = int(time.time() * 1000) + 3_600_000


def request(i: int) -> GenerateRequest:
    return GenerateRequest(f"r{i}", "m", [1, 2, 3], SamplingParams(max_tokens=4), "api-1", DEADLINE_MS)


async def _submitted(redis: aioredis.Redis, bus_config: BusConfig, count: int) -> tuple[GroupConsumer, Keys]:
    """The schedulers' group, with ``count`` requests submitted to it."""
    consumer = request_consumer(redis, bus_config, "s1")
    await consumer.ensure_group()
    producer = Producer(redis, bus_config)
    for i in range(count):
        await submit(producer, bus_config.keys, request(i))
    return consumer, bus_config.keys


async def test_submitted_requests_reach_a_scheduler_and_trim_once_acked(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    consumer, keys = await _submitted(redis, bus_config, 3)
    assert await backlog(redis, keys) == 3
    read = await consumer.read(10, block_ms=0)
    assert [d.message for d in read] == [request(i) for i in range(3)]
    await consumer.ack(read[0].entry_id, read[1].entry_id)
    assert await trim_requests(redis, keys) == 2
    assert await backlog(redis, keys) == 1  # the unacked one stays


async def test_no_request_is_unread_before_the_stream_exists(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """An API started before any scheduler (a fresh Redis): the stream and its group are not there yet."""
    assert not await redis.exists(bus_config.keys.requests)
    assert await unread_requests(redis, bus_config.keys) == 0


async def test_unread_requests_are_those_no_scheduler_read_yet(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer, keys = await _submitted(redis, bus_config, 4)
    assert await unread_requests(redis, keys) == 4
    await consumer.read(3, block_ms=0)
    assert await unread_requests(redis, keys) == 1
    assert await backlog(redis, keys) == 4  # read, not yet trimmed: still in the stream


async def test_a_workers_unread_tasks_are_counted_and_acked_ones_trimmed(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    keys = bus_config.keys
    mine = task_consumer(redis, bus_config, "w1", "w1")
    await mine.ensure_group()
    for i in range(3):
        await Producer(redis, bus_config).send(keys.tasks("w1"), request(i))
    assert await unread_tasks(redis, keys, "w1") == 3
    read = await mine.read(2, block_ms=0)
    assert await unread_tasks(redis, keys, "w1") == 1
    await mine.ack(*[d.entry_id for d in read])
    assert await trim_tasks(redis, keys, "w1") == 2
    reaper = task_consumer(redis, bus_config, "w1", "reaper.s1")  # takes what is left of w1's
    assert [d.message for d in await reaper.read(10, block_ms=0)] == [request(2)]


async def test_unplaced_requests_are_the_unread_and_those_read_not_acked(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A scheduler holds what it read until it is placed (its entry is acked with its dispatch):
    early refusal counts those too, not only the entries nobody read."""
    consumer, keys = await _submitted(redis, bus_config, 4)
    assert await unplaced_requests(redis, keys) == (4, 0)
    read = await consumer.read(3, block_ms=0)
    assert await unplaced_requests(redis, keys) == Unplaced(unread=1, held=3)
    await consumer.ack(read[0].entry_id)
    assert await unplaced_requests(redis, keys) == (1, 2)
