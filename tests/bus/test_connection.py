"""The bus's error classification and its one loop policy (``forever``)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError, ResponseError

from splitbus.bus.connection import forever, is_transient


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
