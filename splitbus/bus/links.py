"""P->D connection records, ``sb:rdma:{prefill}:{decode}``: a hash (``state``, ``endpoint``,
``error``, ``prefill``, ``decode``, ``updated_ms``) with a TTL that the prefill worker refreshes
while it uses the connection, so operators and schedulers can see which pairs are connected.
The prefill worker is the only writer (worker/links.py decides what to record and when)."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from splitbus.bus.core.keys import Keys

LINK_TTL_S = 60
"""A record outlives its last write or refresh by this long."""


class LinkRecords:
    """One prefill worker's records of its connections."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, prefill: str) -> None:
        self._redis = redis
        self._keys = keys
        self.prefill = prefill

    def key(self, decode_worker: str) -> str:
        """The record's key (the ``connect_rdma`` reply names it for operators)."""
        return self._keys.rdma(self.prefill, decode_worker)

    async def write(self, decode_worker: str, fields: dict[FieldT, EncodableT]) -> None:
        """Set ``fields`` in the record and give it a full TTL again (one round trip)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self.key(decode_worker), mapping=fields)
        pipe.expire(self.key(decode_worker), LINK_TTL_S)
        await pipe.execute()

    async def refresh(self, decode_worker: str) -> None:
        """Give the record a full TTL again."""
        await self._redis.expire(self.key(decode_worker), LINK_TTL_S)
