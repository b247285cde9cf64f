"""The follower of many streams (``splitbus.bus.core.follow``): one XREAD, on one Redis or a cluster."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.follow import read_after, read_reply
from splitbus.redis_cluster import EmbeddedCluster
from splitbus.redis_server import EmbeddedRedis


@pytest.fixture(params=["single", "cluster"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[tuple[aioredis.Redis, BusConfig]]:
    """A client of the session's single Redis, then of its cluster."""
    server: EmbeddedRedis | EmbeddedCluster = request.getfixturevalue(
        "redis_server" if request.param == "single" else "redis_cluster"
    )
    config = BusConfig(redis_url=server.url, prefix=f"t{uuid.uuid4().hex[:10]}", block_ms=200)
    redis = connect(config, name="t-follow")
    yield redis, config
    await redis.aclose()


async def test_entries_after_each_cursor_of_many_streams(client: tuple[aioredis.Redis, BusConfig]) -> None:
    redis, config = client
    a, b, c = (config.keys.kv_events(w) for w in ("a", "b", "c"))  # one cell: one slot
    first_a = (await redis.xadd(a, {"n": "1"})).decode()
    second_a = (await redis.xadd(a, {"n": "2"})).decode()
    only_b = (await redis.xadd(b, {"n": "3"})).decode()
    read = await read_after(redis, {a: first_a, b: "0", c: "0"}, 10, None)
    assert read == [(a, second_a, {b"n": b"2"}), (b, only_b, {b"n": b"3"})]
    assert await read_after(redis, {a: second_a, b: only_b}, 10, None) == []
    assert await read_after(redis, {}, 10, None) == []


async def test_at_most_count_per_stream(client: tuple[aioredis.Redis, BusConfig]) -> None:
    redis, config = client
    a = config.keys.kv_events("a")
    ids = [(await redis.xadd(a, {"n": str(i)})).decode() for i in range(5)]
    read = await read_after(redis, {a: "0"}, 2, None)
    assert [entry_id for _, entry_id, _ in read] == ids[:2]


async def test_a_blocking_read_returns_what_is_written_while_it_waits(
    client: tuple[aioredis.Redis, BusConfig],
) -> None:
    redis, config = client
    key = config.keys.cancel
    reading = asyncio.create_task(read_after(redis, {key: "0-0"}, 10, 5000))
    await asyncio.sleep(0.05)
    written = (await redis.xadd(key, {"n": "1"})).decode()
    assert await reading == [(key, written, {b"n": b"1"})]


async def test_a_read_with_block_0_returns_instead_of_waiting_forever(
    client: tuple[aioredis.Redis, BusConfig],
) -> None:
    """Redis reads ``BLOCK 0`` as "forever": a 0 is sent as 1 ms, as the KV-event reader always did."""
    redis, config = client
    key = config.keys.cancel
    assert await asyncio.wait_for(read_after(redis, {key: "0-0"}, 10, 0), timeout=10) == []


async def test_read_reply_is_the_read_as_the_clients_callback_makes_it(
    client: tuple[aioredis.Redis, BusConfig],
) -> None:
    """A result reader's shard keeps Redis's reply: its client's XREAD callback leaves it as sent."""
    redis, config = client
    key = config.keys.cancel
    written = await redis.xadd(key, {"n": "1"})
    assert await read_reply(redis, {key: "0-0"}, 10, None) == [[key.encode(), [(written, {b"n": b"1"})]]]
    redis.set_response_callback("XREAD", lambda response, **options: response)
    assert await read_reply(redis, {key: "0-0"}, 10, None) == [[key.encode(), [[written, [b"n", b"1"]]]]]
    assert await read_reply(redis, {key: written.decode()}, 10, None) is None
