"""The Batcher against a real Redis: replies in order, errors to their own caller only."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from splitbus.bus.core.batching import Batcher
from splitbus.bus.core.config import BusConfig


async def test_concurrent_commands_share_a_pipeline_and_get_their_own_replies(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    batcher = Batcher(redis)
    key = f"{bus_config.prefix}:n"
    replies = await asyncio.gather(*(batcher.call("incr", key) for _ in range(50)))
    assert sorted(replies) == list(range(1, 51)) and replies == sorted(replies)
    assert batcher.pipelines <= 2  # the first call's pipeline, then everything queued meanwhile


async def test_a_failing_command_fails_only_its_caller(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    batcher = Batcher(redis)
    text = f"{bus_config.prefix}:text"
    await redis.set(text, "not a stream")
    good, bad = batcher.call("xadd", f"{bus_config.prefix}:s", {"a": "1"}), batcher.call("xadd", text, {"a": "1"})
    assert await good
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await bad


async def test_a_cancelled_caller_does_not_break_the_batch(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    batcher = Batcher(redis)
    first = batcher.call("incr", f"{bus_config.prefix}:c")
    first.cancel()
    assert await batcher.call("incr", f"{bus_config.prefix}:c") == 2  # the cancelled one still ran


async def test_run_sends_at_once_alone_and_what_queues_meanwhile_goes_after_it(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    batcher = Batcher(redis)
    key = f"{bus_config.prefix}:r"
    assert await batcher.run("incr", key) == 1
    assert batcher.pipelines == 0  # nothing in flight: a command of its own, no pipeline
    first = asyncio.ensure_future(batcher.run("incr", key))
    await asyncio.sleep(0)  # in flight now
    queued = [batcher.call("incr", key) for _ in range(5)] + [asyncio.ensure_future(batcher.run("incr", key))]
    assert await first == 2
    assert sorted(await asyncio.gather(*queued)) == list(range(3, 9))
    assert batcher.pipelines == 1  # all six that queued meanwhile, together, after it
    assert await batcher.run("incr", key) == 9 and batcher.pipelines == 1  # idle again: at once


async def test_run_raises_its_command_s_error_and_the_batcher_goes_on(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    batcher = Batcher(redis)
    text = f"{bus_config.prefix}:text2"
    await redis.set(text, "not a stream")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await batcher.run("xadd", text, {"a": "1"})
    assert await batcher.run("xadd", f"{bus_config.prefix}:s2", {"a": "1"})
    assert await batcher.call("incr", f"{bus_config.prefix}:c2") == 1
