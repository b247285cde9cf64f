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
