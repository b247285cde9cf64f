"""The bus's connection pool (``BusPool``), against the session's redis-server: the cap kept, a
full pool's callers served in turn or refused after the timeout with redis-py's error, no
connection lost to a caller that gives up, and redis-py's connection checks kept."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core import pool as pool_module
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.pool import NO_CONNECTION, BusPool
from splitbus.bus.core.wire import BusConnection
from splitbus.redis_server import EmbeddedRedis

NAME = "pool-test"
READERS = 5
BLOCK_MS = 3000
POLLS = 400
"""At 5 ms a poll: 2 s at least, under BLOCK_MS, so a reader never times out while a test waits."""


def counts(pool: aioredis.ConnectionPool) -> tuple[int, int]:
    """(idle, in use), as redis-py reports them."""
    (idle, _), (in_use, _) = pool.get_connection_count()
    return idle, in_use


async def until(condition: Callable[[], object]) -> None:
    """Poll ``condition``; a guard, not a timing check: fail rather than hang."""
    for _ in range(POLLS):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


async def named_clients(admin: aioredis.Redis, name: str) -> list[dict[str, object]]:
    return [client for client in await admin.client_list() if client.get("name") == name]


async def blocked(admin: aioredis.Redis, name: str) -> int:
    return sum(1 for client in await named_clients(admin, name) if "b" in str(client.get("flags")))


async def until_blocked(admin: aioredis.Redis, name: str, count: int) -> None:
    for _ in range(POLLS):
        if await blocked(admin, name) == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not {count} blocked: {await named_clients(admin, name)}")


@pytest.fixture
async def admin(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """The server's admin (CLIENT LIST, CLIENT KILL), decoding replies."""
    client = aioredis.Redis.from_url(redis_server.admin_url, decode_responses=True)
    yield client
    await client.aclose()


def small_pool(bus_config: BusConfig, max_connections: int, timeout: float | None) -> BusPool:
    return BusPool.from_url(
        bus_config.redis_url, max_connections=max_connections, timeout=timeout, connection_class=BusConnection
    )


async def test_connect_builds_the_bus_pool_with_the_cap_and_the_socket_timeout_as_its_wait(
    bus_config: BusConfig,
) -> None:
    redis = connect(dataclasses.replace(bus_config, socket_timeout_s=3.0), max_connections=7)
    pool = redis.connection_pool
    assert isinstance(pool, BusPool)
    assert (pool.max_connections, pool.timeout, pool.connection_class) == (7, 3.0, BusConnection)
    await redis.aclose()


async def test_a_full_pool_makes_callers_wait_in_turn_for_a_released_connection(
    bus_config: BusConfig, admin: aioredis.Redis
) -> None:
    """max_connections=2, 5 concurrent blocking reads: 2 block on the server, 3 wait in the pool;
    each entry written frees one reader's connection, which goes to the longest waiter; never
    more than 2 connections."""
    redis = connect(bus_config, max_connections=2, name=NAME)
    streams = [f"{bus_config.prefix}:pool:{i}" for i in range(READERS)]
    readers = []
    try:
        for stream in streams:
            readers.append(asyncio.create_task(redis.xread({stream: "0-0"}, block=BLOCK_MS)))
            await asyncio.sleep(0)  # start each in order: the pool serves them in the order they asked
        await until_blocked(admin, NAME, 2)
        assert not any(reader.done() for reader in readers)
        for turn, stream in enumerate(streams):  # readers 0 and 1 hold the connections; 2, 3, 4 wait
            await admin.xadd(stream, {"turn": turn})
            entries = await readers[turn]
            assert entries[0][0] == stream.encode() and entries[0][1][0][1] == {b"turn": str(turn).encode()}
            left = READERS - turn - 1
            await until_blocked(admin, NAME, min(2, left))  # a waiter took the freed connection
            assert len(await named_clients(admin, NAME)) == 2  # the cap
            assert sum(not reader.done() for reader in readers) == left
    finally:
        for reader in readers:
            reader.cancel()
        await redis.aclose()


async def test_waiters_are_served_in_the_order_they_asked(bus_config: BusConfig) -> None:
    pool = small_pool(bus_config, 1, timeout=5.0)
    held = await pool.get_connection()
    waiters = []
    for _ in range(3):
        waiters.append(asyncio.create_task(pool.get_connection()))
        await asyncio.sleep(0)
    for turn, waiter in enumerate(waiters):
        await pool.release(held)
        held = await waiter
        assert [other.done() for other in waiters] == [i <= turn for i in range(3)]
        assert pool.get_connection_count()[1][0] == 1
    await pool.release(held)
    await pool.aclose()


@pytest.mark.parametrize("pool_class", [BusPool, aioredis.BlockingConnectionPool])
async def test_a_wait_past_the_timeout_raises_what_the_blocking_pool_raised(
    bus_config: BusConfig, pool_class: type[aioredis.ConnectionPool]
) -> None:
    """The same error, class and message, as redis-py's blocking pool (run on both)."""
    pool = pool_class.from_url(bus_config.redis_url, max_connections=1, timeout=0.05, connection_class=BusConnection)
    redis = aioredis.Redis.from_pool(pool)
    held = await pool.get_connection()
    with pytest.raises(RedisConnectionError) as raised:
        await redis.ping()
    assert str(raised.value) == NO_CONNECTION == "No connection available."
    await pool.release(held)
    assert await redis.ping()  # the caller that gave up left nothing behind in the queue
    assert counts(pool) == (1, 0)
    await redis.aclose()


async def test_a_waiter_cancelled_as_it_was_handed_a_connection_passes_it_on(bus_config: BusConfig) -> None:
    pool = small_pool(bus_config, 1, timeout=5.0)
    held = await pool.get_connection()
    first = asyncio.create_task(pool.get_connection())
    second = asyncio.create_task(pool.get_connection())
    await until(lambda: len(pool._waiters) == 2)
    await pool.release(held)  # handed to the first waiter, which has not run yet
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    handed = await second  # the connection went on instead of being lost
    assert handed is held and counts(pool) == (0, 1)
    await pool.release(handed)
    assert counts(pool) == (1, 0) and not pool._waiters
    await pool.aclose()


async def test_a_waiter_cancelled_before_its_turn_leaves_the_queue(bus_config: BusConfig) -> None:
    pool = small_pool(bus_config, 1, timeout=None)  # None: a wait for ever, as the blocking pool's
    held = await pool.get_connection()
    waiter = asyncio.create_task(pool.get_connection())
    await until(lambda: pool._waiters)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not pool._waiters
    await pool.release(held)
    again = await pool.get_connection()  # at once: no stale waiter stands before it
    assert again is held
    await pool.release(again)
    await pool.aclose()


async def test_a_connection_dropped_by_the_server_is_reconnected_before_it_is_handed_out(
    bus_config: BusConfig, admin: aioredis.Redis
) -> None:
    redis = connect(bus_config, max_connections=1, name=NAME)
    assert await redis.ping()
    (client,) = await named_clients(admin, NAME)
    await admin.client_kill_filter(_id=client["id"])
    assert await redis.ping()  # redis-py's check of a free connection, kept: a new one, not an error
    (again,) = await named_clients(admin, NAME)
    assert again["id"] != client["id"]
    await redis.aclose()
    assert await named_clients(admin, NAME) == []  # aclose closes the pool's connections


async def test_a_connection_marked_for_reconnect_is_closed_as_it_comes_back(bus_config: BusConfig) -> None:
    pool = small_pool(bus_config, 2, timeout=5.0)
    connection = await pool.get_connection()
    assert connection.is_connected
    connection.mark_for_reconnect()
    await pool.release(connection)
    assert not connection.is_connected and counts(pool) == (1, 0)
    again = await pool.get_connection()
    assert again is connection and again.is_connected
    await pool.release(again)
    await pool.aclose()


async def test_callers_wait_while_redis_pys_pool_lock_is_held(bus_config: BusConfig) -> None:
    """A re-authentication or maintenance step holds the lock while it walks the connections:
    neither taking nor giving back changes the lists under it."""
    pool = small_pool(bus_config, 2, timeout=5.0)
    connection = await pool.get_connection()
    async with pool._lock:
        taking = asyncio.create_task(pool.get_connection())
        giving = asyncio.create_task(pool.release(connection))
        await asyncio.sleep(0.02)
        assert not taking.done() and not giving.done() and counts(pool) == (0, 1)
    other = await taking
    await giving
    assert other is not connection and counts(pool) == (1, 1)  # a new one under the cap; the other given back
    await pool.release(other)
    assert counts(pool)[1] == 0
    await pool.aclose()


async def test_after_a_fork_the_child_drops_the_parents_connections_unclosed(
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = small_pool(bus_config, 1, timeout=5.0)
    parents: AbstractConnection = await pool.get_connection()
    await pool.release(parents)
    child = os.getpid() + 1
    monkeypatch.setattr(pool_module.os, "getpid", lambda: child)  # as a forked child sees it
    childs = await pool.get_connection()
    assert childs is not parents and parents.is_connected  # the parent's socket is left to the parent
    assert counts(pool) == (0, 1)
    await pool.release(childs)
    await pool.aclose()
    await parents.disconnect()
