"""P->D connections, recorded in ``sb:rdma:{P}:{D}`` so operators and schedulers can see them.

``ensure`` is the ``connect_rdma`` action: state goes ``requested`` -> ``connected`` or
``failed`` (with the reason), and the key's TTL is refreshed while the link is used.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from splitbus.bus.core.config import BusConfig
from splitbus.bus.links import LinkRecords
from splitbus.worker.transfer import TransferClient, TransferError

REFRESH_EVERY_S = 10.0
"""How often a used connection's record gets a full TTL again (``bus.links.LINK_TTL_S``)."""


class PeerLinks:
    def __init__(self, redis: aioredis.Redis, config: BusConfig, worker_id: str, client: TransferClient) -> None:
        self.records = LinkRecords(redis, config.keys, worker_id)
        self._worker_id = worker_id
        self.client = client
        self._refreshed: dict[str, float] = {}

    async def ensure(self, decode_worker: str, endpoint: str) -> None:
        """A live connection to ``decode_worker`` at ``endpoint``, or TransferError."""
        if self.client.connected(endpoint):
            await self._refresh(decode_worker)
            return
        await self._record(decode_worker, state="requested", endpoint=endpoint)
        try:
            await self.client.connect(endpoint)
        except TransferError as exc:
            await self._record(decode_worker, state="failed", error=str(exc))
            raise
        await self._record(decode_worker, state="connected", error="")

    async def _refresh(self, decode_worker: str) -> None:
        now = time.monotonic()
        if now - self._refreshed.get(decode_worker, 0.0) > REFRESH_EVERY_S:
            self._refreshed[decode_worker] = now
            await self.records.refresh(decode_worker)

    async def _record(self, decode_worker: str, **fields: str) -> None:
        mapping: dict[FieldT, EncodableT] = dict(fields.items())
        mapping.update(prefill=self._worker_id, decode=decode_worker, updated_ms=str(int(time.time() * 1000)))
        await self.records.write(decode_worker, mapping)
        self._refreshed[decode_worker] = time.monotonic()
