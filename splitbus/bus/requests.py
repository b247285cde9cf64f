"""The request stream, ``sb:requests:{cell}`` (group ``schedulers``): API nodes submit, the scheduler
replicas read. Reads and writes are bus/streams.py's; this module names the stream for them."""

from __future__ import annotations

import re
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from splitbus.bus.codec import NamedRequest
from splitbus.bus.config import BusConfig
from splitbus.bus.keys import SCHEDULER_GROUP, Keys
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.streams import GroupConsumer, Producer, entry_order, trim_consumed


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
    """The requests one API process submitted that have no result yet, and the entry each got:
    what it submits again when Redis lost the entry (a restart from an AOF that missed its last
    second, a failover to a replica that missed the last writes). A request with a result is
    running on a worker, which re-asserts it (docs/reliability.md, "Writes Redis loses")."""

    def __init__(self, redis: aioredis.Redis, producer: Producer, keys: Keys) -> None:
        self._redis = redis
        self._producer = producer
        self._keys = keys
        self._held: dict[str, tuple[str, GenerateRequest]] = {}

    def __len__(self) -> int:
        return len(self._held)

    async def submit(self, request: GenerateRequest) -> str:
        """``submit``, and hold the request until ``started``."""
        entry_id = await submit(self._producer, self._keys, request)
        self._held[request.request_id] = (entry_id, request)
        return entry_id

    def started(self, request_id: str) -> None:
        """The request has a result (or ended, or failed to submit): nothing to re-publish."""
        self._held.pop(request_id, None)

    async def resubmit_lost(self) -> int:
        """Submit again every held request whose entry the stream's log no longer reaches: Redis
        keeps a prefix of its writes, so an entry id past the stream's last generated id (or a
        stream that is gone) was lost. A copy of one that was not lost is only acked by the
        scheduler (its dispatch finds the hand-off id). How many went again."""
        last = await last_entry_id(self._redis, self._keys.requests)
        lost = [r for entry, r in list(self._held.values()) if last is None or entry_order(entry) > entry_order(last)]
        for request in lost:
            if request.request_id in self._held:  # not started meanwhile
                self._held[request.request_id] = (await submit(self._producer, self._keys, request), request)
        return len(lost)


async def last_entry_id(redis: aioredis.Redis, stream: str) -> str | None:
    """The stream's last generated entry id, None if the stream does not exist."""
    try:
        info = await redis.xinfo_stream(stream)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return None
        raise
    last = info.get("last-generated-id") if isinstance(info, dict) else None
    if isinstance(last, bytes):
        last = last.decode()
    if not isinstance(last, str) or not _ENTRY_ID.fullmatch(last):
        raise ResponseError(f"XINFO STREAM {stream} gave no last-generated-id: {str(info)[:80]!r}")
    return last


_ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")
