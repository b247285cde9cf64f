"""A worker's task stream, ``sb:tasks:{cell}:<worker>`` (group ``workers``): the dispatch script writes
it (bus/dispatch.py); the worker reads it, and so do a reaper that moves a dead worker's tasks
and the ranks of a broken DP group that answer a missing rank's. Reads and writes are
bus/core/streams.py's; this module names the stream for them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import redis.asyncio as aioredis

from splitbus.bus.core.codec import NamedRequest
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import WORKER_GROUP, Keys
from splitbus.bus.core.streams import GroupConsumer, Producer, trim_consumed, unread, unread_and_pending
from splitbus.bus.messages import Task


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


async def unsettled_tasks(redis: aioredis.Redis, keys: Keys, worker_id: str) -> int:
    """Tasks the worker has not read, or has read and not acked: none once all written to it is
    done (a task read but not yet taken into its table counts here, not as held)."""
    return sum(await unread_and_pending(redis, keys.tasks(worker_id), WORKER_GROUP))


async def missing_entries(redis: aioredis.Redis, keys: Keys, worker_id: str, entry_ids: Iterable[str]) -> set[str]:
    """Which of these task entries the worker's stream no longer holds: a new Redis run lost
    them (it keeps a prefix of what was written), or they were trimmed once acked. One pipeline
    of ``XRANGE id id`` (one stream: one slot)."""
    ids = list(entry_ids)
    if not ids:
        return set()
    pipe = redis.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(keys.tasks(worker_id), entry_id, entry_id, count=1)
    found = await pipe.execute()
    return {entry_id for entry_id, entries in zip(ids, found, strict=True) if not entries}


async def send_task(redis: aioredis.Redis, config: BusConfig, worker_id: str, task: Task) -> str:
    """Add a task to a worker's stream outside a dispatch: a worker whose dispatch a new Redis run
    lost sends its peer the peer's task again (the same hand-off id: the peer, if it holds the
    request already, acks the copy). Its ``reserved`` must be nothing: no scheduler reserved for
    it. The entry's id."""
    if any(task.reserved):
        raise ValueError("a task sent outside a dispatch reserves nothing")
    return await Producer(redis, config).send(config.keys.tasks(worker_id), task)
