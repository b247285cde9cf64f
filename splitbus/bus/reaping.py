"""The reaping protocol: who takes over a dead worker's tasks, and how often a request moved.

``sb:reaping:{cell}:<worker>`` (``SET NX`` with a TTL) is the mark one scheduler replica takes before it
moves a dead worker's tasks; a worker back from a lapsed lease takes the same mark, so whoever
takes it first decides (docs/reliability.md). ``sb:moved:{cell}:<request>`` counts how often a reaper
moved a request off a dead worker: past ``max_deliveries`` the request fails, and a decode worker
whose KV never came asks it (for a task from before hand-off ids) whether its request moved.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from splitbus.bus.core.keys import Keys

REAPING_TTL_S = 60
"""How long ``sb:reaping:{cell}:<worker>`` (``SET NX``) keeps other reapers off a dead worker whose tasks
one replica redispatches; a worker that rejoins takes the same mark, so no reaper starts then."""
MOVED_TTL_S = 3600
"""How long ``sb:moved:{cell}:<request>`` counts a request's moves after the last one."""


class Reaping:
    """``sb:reaping:{cell}:<worker>`` and ``sb:moved:{cell}:<request>``: one command each, as before the move."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def take(self, worker_id: str, holder: str) -> bool:
        """Take the worker's reaping mark for ``REAPING_TTL_S``; False if someone holds it."""
        return bool(await self._redis.set(self._keys.reaping(worker_id), holder, nx=True, ex=REAPING_TTL_S))

    async def hold(self, worker_id: str, seconds: int) -> None:
        """Keep the mark (taken already) only ``seconds`` more."""
        await self._redis.expire(self._keys.reaping(worker_id), seconds)

    async def release(self, worker_id: str) -> None:
        """Let go of the mark (taken already): the next reaper pass may take the worker again."""
        await self._redis.delete(self._keys.reaping(worker_id))

    async def count_move(self, request_id: str) -> int:
        """One more move of the request; how many it has had (within ``MOVED_TTL_S``)."""
        key = self._keys.moved(request_id)
        moves = await self._redis.incr(key)
        await self._redis.expire(key, MOVED_TTL_S)
        return int(moves)

    async def ever_moved(self, request_id: str) -> bool:
        """Whether a reaper moved the request (within ``MOVED_TTL_S`` of its last move)."""
        return bool(await self._redis.exists(self._keys.moved(request_id)))
