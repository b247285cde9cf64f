"""P->D connection records against a real Redis: written whole with a TTL, refreshed."""

from __future__ import annotations

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.links import LINK_TTL_S, LinkRecords


async def test_a_record_is_written_with_a_ttl_and_refreshed(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    records = LinkRecords(redis, bus_config.keys, "p1")
    key = records.key("d1")
    assert key == bus_config.keys.rdma("p1", "d1")
    await records.write("d1", {"state": "requested", "endpoint": "127.0.0.1:9"})
    await records.write("d1", {"state": "connected", "error": ""})
    assert await redis.hgetall(key) == {b"state": b"connected", b"endpoint": b"127.0.0.1:9", b"error": b""}
    await redis.expire(key, 5)
    await records.refresh("d1")
    assert 5 < await redis.ttl(key) <= LINK_TTL_S
