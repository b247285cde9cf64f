"""The request stream, ``sb:requests:{cell}`` (group ``schedulers``): API nodes submit, the scheduler
replicas read. Reads and writes are bus/core/streams.py's; this module names the stream for them."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from splitbus.bus.core.codec import NamedRequest
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP, Keys
from splitbus.bus.core.streams import GroupConsumer, Producer, trim_consumed
from splitbus.bus.messages import GenerateRequest


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


class Submissions:
    """The requests one API process submitted that have no result yet:
    what it submits again after a new Redis run, which may have lost the entry (a restart from an
    AOF that missed its last second, a failover to a replica that missed the last writes). A
    request with a result is running on a worker, which re-asserts it (docs/reliability.md,
    "Writes Redis loses")."""

    def __init__(self, redis: aioredis.Redis, producer: Producer, keys: Keys) -> None:
        self._redis = redis
        self._producer = producer
        self._keys = keys
        self._held: dict[str, GenerateRequest] = {}

    def __len__(self) -> int:
        return len(self._held)

    async def submit(self, request: GenerateRequest) -> str:
        """``submit``, and hold the request until ``started``."""
        entry_id = await submit(self._producer, self._keys, request)
        self._held[request.request_id] = request
        return entry_id

    def hold(self, request: GenerateRequest) -> None:
        """Hold a request submitted another way (dispatched by its API node itself) until
        ``started``: after a new Redis run it is submitted again to the schedulers."""
        self._held[request.request_id] = request

    def started(self, request_id: str) -> None:
        """The request has a result (or ended, or failed to submit): nothing to re-publish."""
        self._held.pop(request_id, None)

    async def resubmit(self) -> int:
        """Submit again every held request (after a new Redis run). Which entries the run lost
        cannot be told from the stream alone (the first entry written after it gets an id past
        every lost one), and a copy of one that was not lost is only acked by the scheduler (its
        dispatch finds the hand-off id, or dispatches the first copy and acks the second). How
        many went again."""
        held = list(self._held.values())
        for request in held:
            await submit(self._producer, self._keys, request)
        return len(held)
