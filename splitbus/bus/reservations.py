"""A request's KV reservation, ``sb:kv:{request}``: written by the decode worker that reserved
blocks for it, read by the prefill worker that sends it the KV (docs/protocol.md).

A reservation is made for one dispatch of the request (its tasks' hand-off id) and only while
that dispatch is the request's current one (``sb:current:{request}``): a decode task that the
reaper already replaced (its prefill worker died, and the request went to a new pair) reserves
nothing, so it cannot hold blocks, or a prefill worker, for a dispatch that no longer exists.
Both keys carry the request's hash tag.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from splitbus.bus.keys import Keys

TTL_S = 300
"""A reservation outlives any hand-off (the kv wait is far shorter); D deletes it when done."""

_RESERVE = """
local current = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' and current and current ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

_DROP = """
if redis.call('HGET', KEYS[1], 'task_entry') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Reservations:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.keys = keys
        self._reserve = redis.register_script(_RESERVE)
        self._drop = redis.register_script(_DROP)

    async def reserve(self, request_id: str, handoff: str, fields: dict[str, str]) -> bool:
        """Write the reservation for the dispatch ``handoff``; False (nothing written) if the
        request's current dispatch is another. ``handoff`` "" (a task from before hand-off ids),
        or no current id (it outlived its TTL): nothing to compare, written."""
        pairs = [item for pair in fields.items() for item in pair]
        keys = [self.keys.kv(request_id), self.keys.current(request_id)]
        return bool(await self._reserve(keys=keys, args=[handoff, TTL_S, *pairs]))

    async def drop(self, request_id: str, task_entry: str, client: Any = None) -> None:
        """Delete the reservation only if it is still the one the task ``task_entry`` made: the
        request may have moved here again, and its new task's reservation must stay."""
        await self._drop(keys=[self.keys.kv(request_id)], args=[task_entry], client=client)
