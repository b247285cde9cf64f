"""The bus's connection pool (``BusPool``), against the session's redis-server: the cap kept, a
full pool's callers served in turn or refused after the timeout with redis-py's error, no
connection lost to a caller that gives up, and redis-py's connection checks kept."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.auth.token import SimpleToken
from redis.event import AsyncAfterConnectionReleasedEvent, EventDispatcher
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


def small_pool(bus_config: BusConfig, max_connections: int, timeout: float | None, **kwargs: object) -> BusPool:
    return BusPool.from_url(
        bus_config.redis_url, max_connections=max_connections, timeout=timeout, connection_class=BusConnection, **kwargs
    )


async def queued(pool: BusPool, count: int = 1) -> list[asyncio.Task[AbstractConnection]]:
    """``count`` callers of a full pool, each waiting on its future (past the lock) when this returns."""
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(pool.get_connection()))
        await until(lambda: len(pool._waiters) == len(tasks))
    return tasks


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
        await until(lambda: len(pool._lock._waiters or ()) == 2)  # both queued on the lock
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


async def ping_on(pool: BusPool) -> bool:
    connection = await pool.get_connection()
    try:
        await connection.send_command("PING")
        return bool(await connection.read_response() == b"PONG")
    finally:
        await pool.release(connection)
        gc.collect()  # as a child living on would, sooner or later: what the pool dropped is finalized


def child_pings(pool: BusPool) -> None:
    """A forked child's life: a PING on a connection of ``pool``, from an event loop of its own (in a
    thread: this one still holds the parent's running loop), then exit 0 if it was answered."""
    code = 1
    try:
        answered: list[bool] = []
        thread = threading.Thread(target=lambda: answered.append(asyncio.run(asyncio.wait_for(ping_on(pool), 10))))
        thread.start()
        thread.join()
        code = 0 if answered == [True] else 1
    finally:
        os._exit(code)  # never back into pytest


async def test_a_forked_child_using_the_pool_leaves_the_parents_connection_working(bus_config: BusConfig) -> None:
    """Dropping the inherited connections let them be garbage-collected in the child, which closed
    their transports and so took the parent's socket out of the selector the two share: the
    parent's next reply never came (its PING timed out). The fork comes while the parent holds
    redis-py's lock (a re-authentication under way), which the child must not wait for."""
    redis = connect(bus_config, max_connections=1)
    pool = redis.connection_pool
    assert await redis.ping()
    (parents,) = map(id, pool._available_connections)  # no reference: that would keep it alive
    async with pool._lock:
        pid = os.fork()
        if pid == 0:
            child_pings(pool)
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child had a connection of its own, answered
    assert await redis.ping()  # the parent's, on the same connection
    assert list(map(id, pool._available_connections)) == [parents]
    await redis.aclose()


class HeldRelease:
    """A listener of redis-py's release event that holds it until let go: a re-authentication's
    ``AUTH`` in flight."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.go = asyncio.Event()

    async def listen(self, event: AsyncAfterConnectionReleasedEvent) -> None:
        self.started.set()
        await self.go.wait()


async def test_a_connection_re_authenticating_as_it_comes_back_is_handed_out_only_after(bus_config: BusConfig) -> None:
    listener = HeldRelease()
    dispatcher = EventDispatcher({AsyncAfterConnectionReleasedEvent: [listener]})
    pool = small_pool(bus_config, 1, timeout=5.0, event_dispatcher=dispatcher)
    await pool.re_auth_callback(SimpleToken("new", -1, -1, {}))  # nothing to re-authenticate yet; releases now do
    connection = await pool.get_connection()
    releasing = asyncio.create_task(pool.release(connection))
    await listener.started.wait()
    taking = asyncio.create_task(pool.get_connection())
    await until(lambda: pool._waiters or taking.done())
    assert not taking.done() and counts(pool) == (0, 1)  # still in use while its AUTH is under way
    listener.go.set()
    await releasing
    assert await taking is connection
    await pool.release(connection)
    assert counts(pool) == (1, 0)
    await pool.aclose()


async def test_a_waiter_that_gives_up_while_the_lock_is_held_passes_its_connection_on_after(
    bus_config: BusConfig,
) -> None:
    pool = small_pool(bus_config, 1, timeout=5.0)
    held = await pool.get_connection()
    first, second = await queued(pool, 2)
    await pool.release(held)  # handed to the first, which has not run yet
    async with pool._lock:  # a re-authentication walking the lists
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert list(pool._waiters) and held in pool._in_use_connections  # nothing moved under the lock
        assert not second.done()
    assert await second is held  # passed on once the lock was free
    await pool.release(held)
    assert counts(pool) == (1, 0)
    await pool.aclose()


async def test_a_connection_back_under_the_lock_goes_to_a_waiter_once_the_lock_is_free(bus_config: BusConfig) -> None:
    pool = small_pool(bus_config, 1, timeout=5.0)
    held = await pool.get_connection()
    (waiter,) = await queued(pool)
    async with pool._lock:
        pool._in_use_connections.remove(held)  # what redis-py's release does under the lock
        pool._available_connections.append(held)
        pool._hand_on()  # as release's own call does when someone took the lock again
        assert pool._available_connections == [held] and len(pool._waiters) == 1
    assert await waiter is held
    await pool.release(held)
    await pool.aclose()


async def test_a_connection_that_cannot_be_made_fails_its_waiter_not_the_release(
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = small_pool(bus_config, 1, timeout=5.0)
    held = await pool.get_connection()
    first, second = await queued(pool, 2)
    pool.max_connections = 2  # room for a second connection, appearing while both wait
    monkeypatch.setattr(pool, "make_connection", lambda: (_ for _ in ()).throw(RedisConnectionError("unmade")))
    await pool.release(held)  # the first gets it; making the second's fails, not this release
    assert await first is held
    with pytest.raises(RedisConnectionError, match="unmade"):
        await second
    assert counts(pool) == (0, 1) and not pool._waiters
    await pool.release(held)
    await pool.aclose()


def refused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed on leaving: nothing listens there


async def test_a_failed_connect_gives_its_place_back() -> None:
    pool = BusPool.from_url(
        f"redis://127.0.0.1:{refused_port()}", max_connections=1, timeout=5.0, connection_class=BusConnection
    )
    for _ in range(2):  # the second has the place the first gave back: refused too, not left waiting
        with pytest.raises(RedisConnectionError) as raised:
            await pool.get_connection()
        assert str(raised.value) != NO_CONNECTION
    assert counts(pool) == (1, 0) and not pool._waiters
    await pool.aclose()


class FailingRelease:
    """A listener of redis-py's release event that fails: a re-authentication refused."""

    async def listen(self, event: AsyncAfterConnectionReleasedEvent) -> None:
        raise RuntimeError("re-authentication refused")


async def test_a_failed_connect_raises_its_own_error_when_giving_the_place_back_fails_too() -> None:
    dispatcher = EventDispatcher({AsyncAfterConnectionReleasedEvent: [FailingRelease()]})
    pool = BusPool.from_url(
        f"redis://127.0.0.1:{refused_port()}",
        max_connections=1,
        timeout=5.0,
        connection_class=BusConnection,
        event_dispatcher=dispatcher,
    )
    await pool.re_auth_callback(SimpleToken("new", -1, -1, {}))  # releases now dispatch the event
    with pytest.raises(RedisConnectionError) as raised:
        await pool.get_connection()
    assert str(raised.value) != NO_CONNECTION  # the connect's error, not the listener's
    assert counts(pool) == (1, 0)  # the place given back all the same
    await pool.aclose()


async def test_a_caller_cancelled_while_connecting_gives_its_place_back() -> None:
    """A server that accepts and never answers keeps the connect inside ``ensure_connection``."""
    accepted = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # until the client goes
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = BusPool.from_url(f"redis://127.0.0.1:{port}", max_connections=1, timeout=5.0, connection_class=BusConnection)
    connecting = asyncio.create_task(pool.get_connection())
    await accepted.wait()
    connecting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await connecting
    assert counts(pool) == (1, 0) and not pool._waiters
    await pool.aclose()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize(
    "close", [partial(BusPool.disconnect, inuse_connections=True), BusPool.aclose], ids=["disconnect", "aclose"]
)
async def test_closing_the_pool_while_a_caller_waits_leaves_it_a_connected_connection(
    bus_config: BusConfig, close: Callable[[BusPool], Awaitable[None]]
) -> None:
    pool = small_pool(bus_config, 1, timeout=5.0)
    held = await pool.get_connection()
    (waiter,) = await queued(pool)
    await close(pool)
    assert not held.is_connected and not waiter.done()
    await pool.release(held)
    handed = await waiter
    assert handed is held and handed.is_connected  # reconnected by the check before it is handed out
    await pool.release(handed)
    assert counts(pool) == (1, 0)
    await pool.aclose()


async def test_the_waiting_path_records_redis_pys_wait_metrics(
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait, the timeout and a connection made for a waiter, as the blocking pool recorded
    them; nothing on the path that does not wait."""
    recorded: list[str] = []

    async def record(name: str, **_: object) -> None:
        recorded.append(name)

    for name in ("timeout", "wait_time", "create_time"):
        monkeypatch.setattr(pool_module, f"record_connection_{name}", partial(record, name))
    pool = small_pool(bus_config, 1, timeout=0.05)
    held = await pool.get_connection()
    assert recorded == []
    with pytest.raises(RedisConnectionError):
        await pool.get_connection()
    assert recorded == ["timeout"]
    pool.timeout = 5.0
    (waiter,) = await queued(pool)
    await pool.release(held)
    assert await waiter is held and recorded == ["timeout", "wait_time"]  # a free one: nothing made
    await pool.release(held)
    await pool.aclose()
    other = small_pool(bus_config, 1, timeout=5.0)
    async with other._lock:  # a caller that waits for the lock, then has a new connection made
        making = asyncio.create_task(other.get_connection())
        await until(lambda: other._waiters)
    made = await making
    assert made.is_connected and recorded == ["timeout", "wait_time", "create_time", "wait_time"]
    await other.release(made)
    await other.aclose()
