"""The bus's error classification and its one loop policy (``forever``)."""

from __future__ import annotations

import asyncio

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


async def test_a_write_to_a_transport_closed_under_it_is_a_connection_error(
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What uvloop raises then (a RuntimeError) is a ConnectionError, which every bus loop and
    the KV hand-off back off on (a RuntimeError failed hand-offs: tests/faults/test_redis_crash.py);
    the next command connects again."""
    redis = connect(bus_config)
    failures = [RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")]
    send = BusConnection._send_packed_command

    async def closed_once(self: BusConnection, command: list[bytes]) -> None:
        if failures:
            raise failures.pop()
        await send(self, command)

    monkeypatch.setattr(BusConnection, "_send_packed_command", closed_once)
    try:
        with pytest.raises(RedisConnectionError, match="closed under a write"):
            await redis.set(bus_config.keys.dead + ":probe", "1")
        assert await redis.set(bus_config.keys.dead + ":probe", "1")
    finally:
        await redis.aclose()
