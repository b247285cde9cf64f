"""P->D connections, recorded in ``sb:rdma:{P}:{D}`` so operators and schedulers can see them.

``ensure`` is the ``connect_rdma`` action: state goes ``requested`` -> ``connected`` or
``failed`` (with the reason), and the key's TTL is refreshed while the link is used.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from splitbus.bus.config import BusConfig
from splitbus.worker.transfer import TransferClient, TransferError

LINK_TTL_S = 60
REFRESH_EVERY_S = 10.0


class PeerLinks:
    def __init__(self, redis: aioredis.Redis, config: BusConfig, worker_id: str, client: TransferClient) -> None:
        self._redis = redis
        self._keys = config.keys
        self._worker_id = worker_id
        self.client = client
        self._refreshed: dict[str, float] = {}

    async def ensure(self, decode_worker: str, endpoint: str) -> None:
        """A live connection to ``decode_worker`` at ``endpoint``, or TransferError."""
        key = self._keys.rdma(self._worker_id, decode_worker)
        if self.client.connected(endpoint):
            await self._refresh(key)
            return
        await self._record(key, decode_worker, state="requested", endpoint=endpoint)
        try:
            await self.client.connect(endpoint)
        except TransferError as exc:
            await self._record(key, decode_worker, state="failed", error=str(exc))
            raise
        await self._record(key, decode_worker, state="connected", error="")

    async def _refresh(self, key: str) -> None:
        now = time.monotonic()
        if now - self._refreshed.get(key, 0.0) > REFRESH_EVERY_S:
            self._refreshed[key] = now
            await self._redis.expire(key, LINK_TTL_S)

    async def _record(self, key: str, decode_worker: str, **fields: str) -> None:
        mapping: dict[FieldT, EncodableT] = dict(fields.items())
        mapping.update(prefill=self._worker_id, decode=decode_worker, updated_ms=str(int(time.time() * 1000)))
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, mapping=mapping)
        pipe.expire(key, LINK_TTL_S)
        await pipe.execute()
        self._refreshed[key] = time.monotonic()
