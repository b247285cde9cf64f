"""The request stream, ``sb:requests:{cell}`` (group ``schedulers``): API nodes submit, the scheduler
replicas read. Reads and writes are bus/core/streams.py's; this module names the stream for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import redis.asyncio as aioredis

from splitbus.bus.core import codec, metrics
from splitbus.bus.core.codec import NamedRequest
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP, Keys
from splitbus.bus.core.replies import text
from splitbus.bus.core.scripts import LuaScript, declare, lua_string
from splitbus.bus.core.streams import GroupConsumer, Producer, trim_consumed, unread, unread_and_pending
from splitbus.bus.messages import GenerateRequest

UNREAD_LIMIT = 10_000
"""The most unread entries counted where Redis has no ``lag`` (6.2: an ``XRANGE``): the API's
default ``max_backlog``, past which it refuses anyway."""
_TYPE, _DATA, _TS = map(lua_string, ("type", "data", "ts"))  # an entry's fields (``codec.encode``)


_SUBMIT_TOGETHER = declare(
    LuaScript(
        name="submit_together",
        module=__name__,
        keys=("sb:requests:{cell}",),
        argv="per request: its entry's type, data and ts",
        returns="the entries' ids, in order",
        source=f"""
local ids = {{}}
for a = 1, #ARGV, 3 do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', {_TYPE}, ARGV[a], {_DATA}, ARGV[a + 1], {_TS}, ARGV[a + 2])
end
return ids
""",
    )
)
"""Several request entries added at once: a scheduler replica's blocked read is answered only
once the script has run, so one replica reads them all (a response's choices, docs/api.md "n").
A script rather than MULTI: the ``splitbus`` ACL user runs scripts, not transactions."""


async def submit(producer: Producer, keys: Keys, request: GenerateRequest) -> str:
    """Add a request for the schedulers; its entry id."""
    return await producer.send(keys.requests, request)


async def backlog(redis: aioredis.Redis, keys: Keys) -> int:
    """The stream's length: entries not yet trimmed (``trim_requests``), read or not."""
    return int(await redis.xlen(keys.requests))


async def unread_requests(redis: aioredis.Redis, keys: Keys, limit: int = UNREAD_LIMIT) -> int:
    """The entries no scheduler replica has read yet (``XINFO GROUPS``' ``lag``; on Redis 6.2
    counted, at most ``limit``): unlike ``backlog``, not the entries read and not yet trimmed."""
    return await unread(redis, keys.requests, SCHEDULER_GROUP, limit)


class Unplaced(NamedTuple):
    """The requests no scheduler replica has placed yet (``unplaced_requests``)."""

    unread: int
    """Not read yet: the schedulers read them in arrival order."""
    held: int
    """Read and held for a worker (pending: a request's entry is acked when its tasks are
    written), which a scheduler orders by priority and fair share."""


async def unplaced_requests(redis: aioredis.Redis, keys: Keys, limit: int = UNREAD_LIMIT) -> Unplaced:
    """The requests no scheduler replica has placed yet, in one ``XINFO GROUPS``: unread (at
    most ``limit``, as ``unread_requests``) and held."""
    return Unplaced(*await unread_and_pending(redis, keys.requests, SCHEDULER_GROUP, limit))


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
        self._together = _SUBMIT_TOGETHER.register(redis)

    def __len__(self) -> int:
        return len(self._held)

    async def submit(self, request: GenerateRequest) -> str:
        """``submit``, and hold the request until ``started``."""
        entry_id = await submit(self._producer, self._keys, request)
        self._held[request.request_id] = request
        return entry_id

    async def submit_together(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """``submit`` several as one transaction: one scheduler replica reads them in one read
        and places them in one pass (a response's choices, docs/api.md "n")."""
        argv = [value for request in requests for value in codec.script_argv(request)]
        entry_ids = await self._together(keys=[self._keys.requests], args=argv)
        metrics.ENTRIES_PRODUCED.labels(self._keys.kind(self._keys.requests)).inc(len(requests))
        for request in requests:
            self._held[request.request_id] = request
        return [text(i) for i in entry_ids]

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
        choices: dict[str, list[GenerateRequest]] = {}
        for request in held:
            if request.choices > 1:  # a response's choices together again, as they were first
                choices.setdefault(request.choice_group, []).append(request)
            else:
                await submit(self._producer, self._keys, request)
        for group in choices.values():
            await self.submit_together(group)
        return len(held)
