"""The bus's error classification and its one loop policy (``forever``)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.config import BusConfig
from splitbus.bus.connection import BusConnection, connect, forever, is_transient


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


async def test_a_write_to_a_transport_closed_under_it_is_a_connection_error(
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What uvloop raises then (a RuntimeError) is a ConnectionError: redis-py retries it on a new
    connection, so one closed transport costs a retry, not an error; one that stays closed past
    the retries raises the ConnectionError every bus loop and the KV hand-off back off on (a
    RuntimeError failed hand-offs: tests/faults/test_redis_crash.py); the next command connects
    again."""
    redis = connect(bus_config)
    key = bus_config.keys.dead + ":probe"
    failures: list[RuntimeError] = []
    closed = asyncio.Event()
    send = BusConnection._send_packed_command

    async def closing(self: BusConnection, command: list[bytes]) -> None:
        if closed.is_set():
            raise RuntimeError(CLOSED)
        if failures:
            raise failures.pop()
        await send(self, command)

    monkeypatch.setattr(BusConnection, "_send_packed_command", closing)
    try:
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
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py bounds a write with asyncio.wait_for, which on Python 3.11 loses a cancel that
    meets the write's end in one turn of the loop: the cancelled task ran on (a control server,
    cancelled, kept serving, under redis-py 8.2). The cancel is raised, and the command's unread
    reply is not read as the next command's."""
    redis = connect(bus_config)
    key = bus_config.keys.dead + ":cancelled"
    callers: list[asyncio.Task[object]] = []
    send = BusConnection._send_packed_command

    async def cancelled_as_it_writes(self: BusConnection, command: list[bytes]) -> None:
        if callers:
            callers.pop().cancel()  # the caller waits in wait_for; this write ends in the same turn
        await send(self, command)

    async def write() -> object:
        callers.append(cast("asyncio.Task[object]", asyncio.current_task()))
        return await redis.set(key, "cancelled")

    try:
        assert await redis.set(key, "before")
        monkeypatch.setattr(BusConnection, "_send_packed_command", cancelled_as_it_writes)
        task = asyncio.create_task(write())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert callers == [] and task.cancelled()
        assert await redis.set(key + ":next", "1") is True
        assert await redis.get(key + ":next") == b"1"
    finally:
        await redis.aclose()
