"""A worker's task stream, ``sb:tasks:{cell}:<worker>`` (group ``workers``): the dispatch script writes
it (bus/dispatch.py); the worker reads it, and so do a reaper that moves a dead worker's tasks
and the ranks of a broken DP group that answer a missing rank's. Reads and writes are
bus/streams.py's; this module names the stream for them."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from splitbus.bus.codec import NamedRequest
from splitbus.bus.config import BusConfig
from splitbus.bus.keys import WORKER_GROUP, Keys
from splitbus.bus.streams import GroupConsumer, trim_consumed, unread


def task_consumer(
    redis: aioredis.Redis,
    config: BusConfig,
    worker_id: str,
    consumer: str,
    on_dead: Callable[[NamedRequest, str], None] | None = None,
) -> GroupConsumer:
    """``consumer`` in group ``workers`` on ``worker_id``'s task stream (the worker itself, or
    whoever takes over its tasks)."""
    return GroupConsumer(redis, config, config.keys.tasks(worker_id), WORKER_GROUP, consumer, on_dead=on_dead)


async def trim_tasks(redis: aioredis.Redis, keys: Keys, worker_id: str) -> int:
    """Delete the worker's task entries once acked (never an unacked one); how many went."""
    return await trim_consumed(redis, keys.tasks(worker_id))


async def unread_tasks(redis: aioredis.Redis, keys: Keys, worker_id: str) -> int:
    """Tasks the worker has not read yet."""
    return await unread(redis, keys.tasks(worker_id), WORKER_GROUP)
