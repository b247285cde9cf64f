"""The reaping protocol against a real Redis: one holder of a dead worker's mark, and the
count of a request's moves (with their TTLs)."""

from __future__ import annotations

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.reaping import MOVED_TTL_S, REAPING_TTL_S, Reaping


async def test_one_holder_takes_a_workers_mark_until_it_is_let_go(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    reaping = Reaping(redis, bus_config.keys)
    assert await reaping.take("w1", "s1")
    assert not await reaping.take("w1", "w1:rejoining")
    assert await reaping.take("w2", "s1")  # another worker's mark is its own
    key = bus_config.keys.reaping("w1")
    assert await redis.get(key) == b"s1"
    assert 0 < await redis.ttl(key) <= REAPING_TTL_S
    await reaping.hold("w1", 2)
    assert 0 < await redis.ttl(key) <= 2


async def test_moves_are_counted_per_request_with_a_ttl(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    reaping = Reaping(redis, bus_config.keys)
    assert not await reaping.ever_moved("r1")
    assert [await reaping.count_move("r1") for _ in range(3)] == [1, 2, 3]
    assert await reaping.count_move("r2") == 1
    assert await reaping.ever_moved("r1")
    assert 0 < await redis.ttl(bus_config.keys.moved("r1")) <= MOVED_TTL_S
