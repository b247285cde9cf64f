"""The bus's error classification, its one loop policy (``forever``), and its connections'
guarded writes, on a single Redis and on every node of a cluster."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import cast

import pytest
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import Connection
from redis.crc import key_slot
from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.cluster import BusCluster, cluster_url, parse_cluster_url
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect, forever, is_transient
from splitbus.bus.core.wire import BusConnection, BusSSLConnection, guarded
from splitbus.redis_cluster import EmbeddedCluster


@pytest.mark.parametrize(
    "exc, transient",
    [
        (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), True),
        # What Redis 6.2 answers when a script meets maxmemory (measured on the test server).
        (
            ResponseError(
                "Error running script (call to f_bd6f): @user_script:1: @user_script: 1: "
                "-OOM command not allowed when used memory > 'maxmemory'."
            ),
            True,
        ),
        (
            ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT."),
            True,
        ),
        (
            ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist"),
            True,
        ),
        (ResponseError("NOREPLICAS Not enough good replicas to write."), True),
        (BusyLoadingError("Redis is loading the dataset in memory"), True),
        (ReadOnlyError("You can't write against a read only replica."), True),
        (ConnectionResetError(), True),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
        (ResponseError("ERR Error running script: @user_script:1: WRONGTYPE"), False),
        (ValueError("a bug"), False),
        # uvloop's error for a write to a transport closed under it (a server killed mid-connect)
        (
            RuntimeError(
                "unable to perform operation on <TCPTransport closed=True reading=False>; the handler is closed"
            ),
            True,
        ),
        (RuntimeError("a bug"), False),
    ],
)
def test_is_transient(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


async def test_forever_waits_out_transient_errors_and_raises_anything_else() -> None:
    calls: list[int] = []

    async def step() -> None:
        calls.append(1)
        if len(calls) <= 3:
            raise OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
        if len(calls) == 5:
            raise KeyError("a bug in the loop")

    with pytest.raises(KeyError):
        await asyncio.wait_for(forever(step, lambda: False, "test"), 30)
    assert len(calls) == 5  # three refusals waited out, one good step, then the bug ends it


async def test_forever_ends_when_told() -> None:
    stop = asyncio.Event()

    async def step() -> None:
        stop.set()

    await asyncio.wait_for(forever(step, stop.is_set, "test"), 5)


CLOSED = "unable to perform operation on <TCPTransport closed=True>; the handler is closed"
SEND = Connection._send_packed_command
"""redis-py's write, under every connection class (plain, TLS, and the bus's): the tests below
patch it there, so that a cluster node's connection meets what they inject whatever its class."""


@pytest.fixture(params=["single", "cluster"])
def either_config(request: pytest.FixtureRequest, bus_config: BusConfig) -> BusConfig:
    """The test's bus on the session's single Redis, or on its cluster (TLS on every port)."""
    if request.param == "single":
        return bus_config
    cluster: EmbeddedCluster = request.getfixturevalue("redis_cluster")
    return dataclasses.replace(bus_config, redis_url=cluster.url)


async def test_a_write_to_a_transport_closed_under_it_is_a_connection_error(
    either_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What uvloop raises then (a RuntimeError) is a ConnectionError: redis-py retries it on a new
    connection, so one closed transport costs a retry, not an error; one that stays closed past
    the retries raises the ConnectionError every bus loop and the KV hand-off back off on (a
    RuntimeError failed hand-offs: tests/faults/test_redis_crash.py); the next command connects
    again. On a cluster too, where redis-py alone let the RuntimeError through."""
    redis = connect(either_config)
    key = either_config.keys.dead + ":probe"
    failures: list[RuntimeError] = []
    closed = asyncio.Event()

    async def closing(self: Connection, command: list[bytes]) -> None:
        if closed.is_set():
            raise RuntimeError(CLOSED)
        if failures:
            raise failures.pop()
        await SEND(self, command)

    try:
        assert await redis.set(key, "before")  # on a cluster, the slot map read
        monkeypatch.setattr(Connection, "_send_packed_command", closing)
        failures.append(RuntimeError(CLOSED))
        assert await redis.set(key, "once")
        assert failures == []  # the write met it, and its retry went through
        closed.set()
        with pytest.raises(RedisConnectionError, match="closed under a write"):
            await redis.set(key, "never")
        closed.clear()
        assert await redis.set(key, "again") and await redis.get(key) == b"again"
    finally:
        await redis.aclose()


async def test_a_cancel_that_arrives_as_a_write_completes_cancels_the_command(
    either_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py bounds a write with asyncio.wait_for, which on Python 3.11 loses a cancel that
    meets the write's end in one turn of the loop: the cancelled task ran on (a control server,
    cancelled, kept serving, under redis-py 8.2). The cancel is raised, and the command's unread
    reply is not read as the next command's. On a cluster's node too (redis-py alone builds its
    nodes' connections itself, and there the cancelled task ran on)."""
    redis = connect(either_config)
    key = either_config.keys.dead + ":cancelled"
    callers: list[asyncio.Task[object]] = []

    async def cancelled_as_it_writes(self: Connection, command: list[bytes]) -> None:
        if callers:
            callers.pop().cancel()  # the caller waits in wait_for; this write ends in the same turn
        await SEND(self, command)

    async def write() -> object:
        callers.append(cast("asyncio.Task[object]", asyncio.current_task()))
        return await redis.set(key, "cancelled")

    try:
        assert await redis.set(key, "before")
        monkeypatch.setattr(Connection, "_send_packed_command", cancelled_as_it_writes)
        task = asyncio.create_task(write())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert callers == [] and task.cancelled()
        assert await redis.set(key + ":next", "1") is True  # the same slot: the same node
        assert await redis.get(key + ":next") == b"1"
    finally:
        await redis.aclose()


@pytest.mark.parametrize("scheme, bus_class", [("redis+cluster", BusConnection), ("rediss+cluster", BusSSLConnection)])
async def test_a_cluster_client_connects_to_every_node_with_the_bus_connection(
    scheme: str, bus_class: type[Connection]
) -> None:
    """Plain and TLS: the startup nodes, and a node made later from the client's node settings
    (as redis-py makes those of the slot map, of a MOVED, of a refresh), open the bus's
    connections, not the ``Connection`` or ``SSLConnection`` that redis-py puts there."""
    client = connect(BusConfig(redis_url=f"{scheme}://u:pw@127.0.0.1:7000,127.0.0.1:7001"))
    assert isinstance(client, BusCluster)
    try:
        later = ClusterNode("127.0.0.1", 7002, **client.nodes_manager.connection_kwargs)
        nodes = [*client.nodes_manager.startup_nodes.values(), later]
        assert [type(node.acquire_connection()) for node in nodes] == [bus_class] * 3  # none connects yet
    finally:
        await client.aclose()


def test_a_connection_class_the_bus_has_no_guarded_form_of_is_refused() -> None:
    """A redis-py that put another class in its node settings fails the first client it builds,
    rather than running without the guards."""
    assert guarded(Connection) is BusConnection and guarded(BusSSLConnection) is BusSSLConnection
    with pytest.raises(TypeError, match="no guarded form of Other"):
        guarded(type("Other", (Connection,), {}))


async def test_nodes_a_cluster_client_finds_or_is_moved_to_use_the_bus_connection(
    redis_cluster: EmbeddedCluster, bus_config: BusConfig
) -> None:
    """Started from one node, the client finds the others in the slot map; a MOVED to a node it
    has forgotten (a slot map gone stale) makes that node anew: every connection it then opens,
    on every primary, is the bus's (TLS: the session cluster runs it on every port)."""
    url = parse_cluster_url(redis_cluster.url)
    one = dataclasses.replace(
        bus_config, redis_url=cluster_url(url.username or "", url.password or "", [url.nodes[0]], url.tls)
    )
    client = connect(one)
    assert isinstance(client, BusCluster)
    keys = [f"{bus_config.prefix}:{{k{i}}}" for i in range(30)]
    try:
        await client.initialize()
        manager = client.nodes_manager
        forgotten = next(node for node in client.get_primaries() if not node._connections)
        stand_in = next(node for node in client.get_primaries() if node is not forgotten)
        del manager.nodes_cache[forgotten.name]
        for slot, nodes in manager.slots_cache.items():
            if nodes[0] is forgotten:
                manager.slots_cache[slot] = [stand_in]
        for i, key in enumerate(keys):
            assert await client.set(key, i)
        moved_to = manager.nodes_cache[forgotten.name]
        assert moved_to is not forgotten and moved_to._connections  # made anew by the MOVED, and used
        assert any(manager.slots_cache[key_slot(key.encode())][0] is moved_to for key in keys)
        opened = [conn for node in manager.nodes_cache.values() for conn in node._connections]
        assert len({conn.port for conn in opened}) >= 3 and {type(conn) for conn in opened} == {BusSSLConnection}
    finally:
        await client.aclose()
