"""The request stream, ``sb:requests:{cell}`` (group ``schedulers``): API nodes submit, the scheduler
replicas read. Reads and writes are bus/streams.py's; this module names the stream for them."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from splitbus.bus.codec import NamedRequest
from splitbus.bus.config import BusConfig
from splitbus.bus.keys import SCHEDULER_GROUP, Keys
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.streams import GroupConsumer, Producer, trim_consumed


async def submit(producer: Producer, keys: Keys, request: GenerateRequest) -> str:
    """Add a request for the schedulers; its entry id."""
    return await producer.send(keys.requests, request)


async def backlog(redis: aioredis.Redis, keys: Keys) -> int:
    """The stream's length: entries not yet trimmed (``trim_requests``), read or not."""
    return int(await redis.xlen(keys.requests))


def request_consumer(
    redis: aioredis.Redis, config: BusConfig, name: str, on_dead: Callable[[NamedRequest, str], None] | None = None
) -> GroupConsumer:
    """Scheduler replica ``name`` in group ``schedulers``."""
    return GroupConsumer(redis, config, config.keys.requests, SCHEDULER_GROUP, name, on_dead=on_dead)


async def trim_requests(redis: aioredis.Redis, keys: Keys) -> int:
    """Delete request entries every replica has acked; how many went."""
    return await trim_consumed(redis, keys.requests)
