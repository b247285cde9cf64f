"""A request's KV reservation, ``sb:kv:{cell}:<request>``: written by the decode worker that reserved
blocks for it, read by the prefill worker that sends it the KV and by a reaper that frees the
decode side of a dead prefill worker's request (docs/protocol.md). This module is the only one
that names the key or runs its scripts.

A reservation is made for one dispatch of the request (its tasks' hand-off id) and only while
that dispatch is the request's current one (``sb:current:{cell}:<request>``): a decode task that the
reaper already replaced (its prefill worker died, and the request went to a new pair) reserves
nothing, so it cannot hold blocks, or a prefill worker, for a dispatch that no longer exists.
Both keys carry the request's hash tag.

Anyone who can write to Redis can write the hash, so what is read from it is validated
(``Reservation``, a pure record in ``splitbus.bus.records``): types and sizes; whether it is the
reservation a reader may use is the reader's check (``Reservation.made_for``, and P's comparison
of the endpoint with D's registry record).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from splitbus.bus.core.cluster import as_cluster
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.scripts import LuaScript, declare
from splitbus.bus.records import FIELDS, Reservation

log = logging.getLogger(__name__)

TTL_S = 300
"""A reservation outlives any hand-off (the kv wait is far shorter); D deletes it when done."""
_RESERVE = declare(
    LuaScript(
        name="reserve_kv",
        module=__name__,
        keys=("sb:kv:{cell}:<request>", "sb:current:{cell}:<request>"),
        argv='the task\'s hand-off id ("" for none), the TTL (s), then field, value pairs',
        returns="1: written (HSET, EXPIRE); 0: the request's current dispatch is another, nothing written",
        source="""
local current = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' and current and current ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
""",
    )
)

_DROP = declare(
    LuaScript(
        name="drop_kv",
        module=__name__,
        keys=("sb:kv:{cell}:<request>",),
        argv="the task entry id that made the reservation",
        returns="1: deleted; 0: the reservation is another task's (or gone), left alone",
        source="""
if redis.call('HGET', KEYS[1], 'task_entry') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""",
    )
)


class Reservations:
    """The ``sb:kv`` protocol: reserve, read, drop."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.keys = keys
        self._redis = redis
        self._reserve = _RESERVE.register(redis)
        self._drop = _DROP.register(redis)

    async def reserve(self, request_id: str, reservation: Reservation) -> bool:
        """Write the reservation for its dispatch (``reservation.handoff``); False (nothing
        written) if the request's current dispatch is another. Handoff "" (a task from before
        hand-off ids), or no current id (it outlived its TTL): nothing to compare, written."""
        pairs = [item for pair in reservation.to_hash().items() for item in pair]
        keys = [self.keys.kv(request_id), self.keys.current(request_id)]
        return bool(await self._reserve(keys=keys, args=[reservation.handoff, TTL_S, *pairs]))

    async def read(self, request_id: str) -> Reservation | None:
        """The request's reservation; None if there is none, or it is not a valid one."""
        reply = await self._redis.hmget(self.keys.kv(request_id), FIELDS)
        return self.parse(request_id, cast(list[bytes | None], reply))

    def queue_read(self, pipe: Pipeline, request_id: str) -> None:
        """Add the read to a pipeline that goes out anyway (P's poll reads D's record with it);
        its reply is for ``parse``."""
        pipe.hmget(self.keys.kv(request_id), FIELDS)

    @staticmethod
    def parse(request_id: str, reply: Sequence[bytes | None]) -> Reservation | None:
        """The reservation in a ``queue_read`` reply; None if there is none or it is invalid
        (logged at debug level: P polls a forged one until its kv wait ends)."""
        if all(value is None for value in reply):
            return None
        try:
            return Reservation.from_reply(reply)
        except ValueError as exc:
            log.debug("ignoring the invalid KV reservation of %s: %s", request_id, exc)
            return None

    async def drop(self, request_id: str, task_entry: str, client: aioredis.Redis | None = None) -> None:
        """Delete the reservation only if it is still the one the task ``task_entry`` made: the
        request may have moved here again, and its new task's reservation must stay. ``client``:
        a pipeline to queue it in; on a cluster it runs at once instead (a cluster pipeline does not
        load a script where it is missing; the script call here does)."""
        if as_cluster(self._redis) is not None:
            client = None
        await self._drop(keys=[self.keys.kv(request_id)], args=[task_entry], client=client)
