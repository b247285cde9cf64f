"""Redis restarts under a live producer, group consumer and result reader."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import TRANSIENT_ERRORS, connect
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.messages import Cancel
from splitbus.bus.results import ResultReader, ResultWriter
from splitbus.redis_server import EmbeddedRedis


async def _until_ok(coro_fn, attempts: int = 100):  # type: ignore[no-untyped-def]
    for _ in range(attempts):
        try:
            return await coro_fn()
        except TRANSIENT_ERRORS:
            await asyncio.sleep(0.05)
    raise AssertionError("Redis did not come back")


@pytest.mark.parametrize("appendonly", [True, False], ids=["aof", "no-persistence"])
async def test_parts_reconnect_after_restart(tmp_path: Path, appendonly: bool) -> None:
    server = EmbeddedRedis(tmp_path, appendonly=appendonly)
    server.start()
    config = BusConfig(redis_url=server.url, block_ms=200, socket_timeout_s=1.0)
    redis = connect(config)
    reader = ResultReader(config, redis, name="api-r")
    await reader.start()
    try:
        consumer = GroupConsumer(redis, config, config.keys.requests, "schedulers", "s1")
        await consumer.ensure_group()
        producer = Producer(redis, config)
        await producer.send(config.keys.requests, Cancel("before"))
        sub = await reader.subscribe("req")
        server.stop()
        with pytest.raises(TRANSIENT_ERRORS):
            await producer.send(config.keys.requests, Cancel("during"))
        server.start()  # same port, same data folder
        await _until_ok(lambda: producer.send(config.keys.requests, Cancel("after")))
        got = await _until_ok(lambda: consumer.read(10))
        expected = ["before", "after"] if appendonly else ["after"]  # AOF kept the entry
        assert [d.message.request_id for d in got] == expected
        writer = ResultWriter(redis, config)
        writer.open("req", reader=reader.reader_of("req"))
        writer.tokens("req", [1])
        writer.finish("req", "stop", 1, 1)
        await writer.flush()
        results = await asyncio.wait_for(_drain(sub), 10)
        assert [r.seq for r in results] == [0, 1]
    finally:
        await reader.close()
        await redis.aclose()
        server.stop()


async def _drain(sub):  # type: ignore[no-untyped-def]
    return [r async for r in sub]
