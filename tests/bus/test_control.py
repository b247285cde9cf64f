"""The control protocol against a real Redis: replies, error replies, dead letters, TTL."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from splitbus.bus.control import REPLY_TTL_S, CommandFailed, ControlServer, call
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.dead import DeadLetter


async def _echo(args: dict[str, Any]) -> dict[str, Any]:
    return {"echo": args}


async def _refuse(args: dict[str, Any]) -> dict[str, Any]:
    raise CommandFailed("not today")


async def _crash(args: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("boom")


async def _serving(redis: aioredis.Redis, bus_config: BusConfig) -> tuple[ControlServer, asyncio.Task[None]]:
    server = ControlServer(redis, bus_config, "w1", {"echo": _echo, "refuse": _refuse, "crash": _crash})
    await server.start()

    async def loop() -> None:
        while True:
            await server.serve_once()

    return server, asyncio.create_task(loop())


async def test_a_command_gets_its_result_on_its_reply_stream(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    _, task = await _serving(redis, bus_config)
    reply = await call(redis, bus_config, "w1", "echo", {"x": 1})
    task.cancel()
    assert reply.ok and reply.result == {"echo": {"x": 1}} and reply.worker == "w1" and reply.cmd == "echo"
    ttl = await redis.ttl(bus_config.keys.reply(reply.task_id))
    assert 0 < ttl <= REPLY_TTL_S


@pytest.mark.parametrize(
    ("cmd", "error"),
    [
        ("nope", "unknown command 'nope'; known: echo, refuse, crash"),
        ("refuse", "not today"),
        ("crash", "RuntimeError: boom"),
    ],
)
async def test_failures_get_an_error_reply_and_the_server_goes_on(
    redis: aioredis.Redis, bus_config: BusConfig, cmd: str, error: str
) -> None:
    _, task = await _serving(redis, bus_config)
    failed = await call(redis, bus_config, "w1", cmd)
    after = await call(redis, bus_config, "w1", "echo")
    task.cancel()
    assert not failed.ok and failed.error == error
    assert after.ok


async def test_malformed_commands_with_a_task_id_get_an_error_reply(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    server, task = await _serving(redis, bus_config)
    await redis.xadd(server.stream, {"type": "command", "data": orjson.dumps({"task_id": "t-bad", "cmd": 7})})
    await redis.xadd(server.stream, {"type": "cancel", "data": orjson.dumps({"task_id": "t-wrong", "request_id": "r"})})
    replies = [await redis.xread({bus_config.keys.reply(t): "0"}, block=2000) for t in ("t-bad", "t-wrong")]
    task.cancel()
    bad, wrong = (codec.decode(r[0][1][0][1]) for r in replies)
    assert not bad.ok and "cmd must be a string" in bad.error
    assert not wrong.ok and "expected an entry of type 'command', got 'cancel'" in wrong.error


async def test_entries_with_nobody_to_answer_go_to_dead_letters(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    server, task = await _serving(redis, bus_config)
    await redis.xadd(server.stream, {"type": "command", "data": b"{not json"})
    await redis.xadd(server.stream, {"garbage": "1"})
    after = await call(redis, bus_config, "w1", "echo")
    task.cancel()
    assert after.ok
    letters = [codec.decode(fields) for _, fields in await redis.xrange(bus_config.keys.dead)]
    assert [(d.stream, d.reason) for d in letters if isinstance(d, DeadLetter)] == [(server.stream, "undecodable")] * 2
    assert (await redis.xpending(server.stream, "workers"))["pending"] == 0


async def test_a_worker_that_does_not_answer_times_out_clearly(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    with pytest.raises(TimeoutError, match="worker ghost did not answer get_payload within 0.3 s"):
        await call(redis, bus_config, "ghost", "get_payload", timeout_s=0.3)
    assert await redis.xlen(bus_config.keys.ctrl("ghost")) == 0  # withdrawn
