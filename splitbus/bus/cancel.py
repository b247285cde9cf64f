"""Cancellations: one stream that every worker and scheduler reads in full (no group)."""

from __future__ import annotations

import logging
from typing import cast

import redis.asyncio as aioredis

from splitbus.bus.core import codec, follow, metrics
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.replies import Entry, EntryFields, for_xadd
from splitbus.bus.messages.cancel import Cancel

log = logging.getLogger(__name__)

CANCEL_MAXLEN = 100_000
"""Approximate length kept: a reader further behind than this misses cancellations."""


async def publish_cancel(
    redis: aioredis.Redis, config: BusConfig, request_id: str, reason: str, worker: str = "", task_entry: str = ""
) -> str:
    """Cancel a request everywhere, or (``worker`` and ``task_entry``) one worker's task of it."""
    cancel = Cancel(request_id, reason, worker, task_entry)
    fields = for_xadd(codec.encode(cancel))
    entry_id = cast(bytes, await redis.xadd(config.keys.cancel, fields, maxlen=CANCEL_MAXLEN, approximate=True))
    metrics.ENTRIES_PRODUCED.labels("cancel").inc()
    return entry_id.decode()


class CancelListener:
    """Reads cancellations published after it started (and after any reconnect, from where it
    left off: it always reads with an explicit last id, never ``$``)."""

    def __init__(self, redis: aioredis.Redis, config: BusConfig) -> None:
        self._redis = redis
        self._config = config
        self._last_id: str | None = None

    async def start(self) -> None:
        """Remember the current end of the stream; earlier cancellations do not concern us."""
        newest = cast(list[Entry], await self._redis.xrevrange(self._config.keys.cancel, count=1))
        self._last_id = newest[0][0].decode() if newest else "0-0"

    async def poll(self, block_ms: int | None = None) -> list[Cancel]:
        if self._last_id is None:
            await self.start()
        block = self._config.block_ms if block_ms is None else block_ms
        key = self._config.keys.cancel
        entries = await follow.read_after(self._redis, {key: self._last_id or "0-0"}, 1000, block)
        if entries:
            self._last_id = entries[-1][1]
        cancels = [c for c in (self._decode(entry_id, fields) for _, entry_id, fields in entries) if c is not None]
        metrics.ENTRIES_CONSUMED.labels("cancel").inc(len(cancels))
        return cancels

    @staticmethod
    def _decode(entry_id: str, fields: EntryFields) -> Cancel | None:
        try:
            msg = codec.decode(fields)
        except DecodeError as exc:
            log.error("undecodable cancel entry %s: %s", entry_id, exc)
            return None
        return msg if isinstance(msg, Cancel) else None
